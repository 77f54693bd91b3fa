//! A hostile user of the safe API: everything here compiles without
//! `unsafe` (except registering pool memory, whose contract is kept), and
//! each case must end in `Ok`, or `Err` of the documented kind; never a
//! crash, a hang, freed memory read or wrong bytes. Cases that could take
//! the process down run in a child process (this binary re-run with
//! `KVH_HOSTILE_CHILD` naming the case), so a crash fails only that test.

mod common;

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvh::{
    codec, AttentionParams, Backend, Codec, Config, DType, Engine, KvPolicy, LogLevel, OffloadItem,
    Pool, Scope, Status, Tier,
};

const CHILD_VAR: &str = "KVH_HOSTILE_CHILD";

/// The cases run in a child process, by name.
const CHILD_CASES: &[(&str, fn())] = &[
    ("huge_read_kv_vec", child_huge_read_kv_vec),
    ("empty_view_slices", child_empty_view_slices),
    ("log_sink_drops_engine", child_log_sink_drops_engine),
    (
        "log_sink_drops_last_engine_on_worker",
        child_log_sink_drops_last_engine_on_worker,
    ),
    ("panic_with_guards_alive", child_panic_with_guards_alive),
];

/// Entry of the child process: runs the case named by `KVH_HOSTILE_CHILD`
/// (nothing in a normal run).
#[test]
fn child_entry() {
    common::run_child_case(CHILD_VAR, CHILD_CASES);
}

// ---------------------------------------------------------------- children

fn child_huge_read_kv_vec() {
    let e = common::small();
    let s = e.create_sequence(0).unwrap();
    s.append(&[1, 2, 3]).unwrap();
    common::fill(&e, &s, 1);
    // n tokens that do not exist: a Range error, not an allocation of
    // n * token_elems elements (which aborts the process).
    for n in [1usize << 40, 1 << 50, usize::MAX / 16, usize::MAX] {
        let err = s.read_kv_vec::<f32>(0, 0, n).unwrap_err();
        assert!(
            matches!(err.status(), Status::Range | Status::InvalidArg),
            "n = {n}: {err}"
        );
    }
    let err = s.read_kv_vec::<f32>(0, u64::MAX, 1).unwrap_err();
    assert_eq!(err.status(), Status::Range);
    let (k, v) = s.read_kv_vec::<f32>(1, 1, 2).unwrap();
    assert_eq!((k.len(), v.len()), (32, 32));
    let (k, _) = s.read_kv_vec::<f32>(0, 3, 0).unwrap();
    assert!(k.is_empty());
}

fn child_empty_view_slices() {
    let e = common::vmap_engine();
    let s = e.create_sequence(0).unwrap();
    // A view of no tokens, made to grow: its slices are empty, not built
    // from a NULL pointer.
    match s.vmap(0, 64) {
        Ok(view) => {
            assert_eq!(view.info().unwrap().n_tokens, 0);
            assert!(view.k::<f32>(0).unwrap().is_empty());
            assert!(view.v::<f32>(1).unwrap().is_empty());
        }
        Err(err) => assert!(
            matches!(
                err.status(),
                Status::Range | Status::Unsupported | Status::InvalidArg
            ),
            "{err}"
        ),
    }
    // A view truncated to nothing and refreshed.
    s.append(&[3; 32]).unwrap();
    let kv = vec![0.5f32; 32 * 128];
    s.write_kv(0, 0, &kv, &kv).unwrap();
    let mut view = match s.vmap(0, 64) {
        Ok(v) => v,
        Err(err) if err.status() == Status::Unsupported => return,
        Err(err) => panic!("vmap: {err}"),
    };
    assert_eq!(view.k::<f32>(1).unwrap().len(), 32 * 64);
    assert!(view.k::<f32>(2).is_err());
    assert!(view.k::<u16>(0).is_err());
    s.truncate(0).unwrap();
    let _ = view.refresh();
    if let Ok(k) = view.k::<f32>(0) {
        assert!(k.is_empty() || k.iter().all(|&x| x == 0.5));
    }
}

fn child_log_sink_drops_engine() {
    // The sink owns the last reference to its own engine and drops it
    // while being called: the sink's state must stay alive for the call.
    let slot: Arc<Mutex<Option<Arc<Engine>>>> = Arc::new(Mutex::new(None));
    let in_sink = slot.clone();
    let engine = Arc::new(
        Engine::open(
            Config::new()
                .backend(Backend::Cpu)
                .dtype(DType::F32)
                .head_dim(8)
                .block_tokens(4)
                .device_bytes(2 * 2 * 4 * 8 * 4)
                .host_bytes(0)
                .log(LogLevel::Debug, move |_, _| {
                    let taken = in_sink.lock().unwrap().take();
                    // Dropped here, maybe the last reference.
                    drop(taken);
                }),
        )
        .unwrap(),
    );
    *slot.lock().unwrap() = Some(engine.clone());
    {
        let s = engine.create_sequence(0).unwrap();
        // Fill the device tier and fail: that is logged.
        let _ = s.append(&[1; 64]);
        let _ = s.acquire(0..1000);
    }
    drop(engine);
    // Whatever is left is dropped here.
    slot.lock().unwrap().take();
}

/// Sets its flag when dropped: the sink's state going away.
struct Gone(Arc<AtomicBool>);

impl Drop for Gone {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

fn child_log_sink_drops_last_engine_on_worker() {
    // A store whose blocks fail their checksum when read back, so that
    // moving them logs on the migration worker.
    let tokens: Vec<i32> = (0..8).collect();
    let (dir, config) = common::store_failing_checksums("sink-drop", &tokens);

    // The sink holds the only handle of its own engine and drops it, on
    // the worker: the engine must then stay open with the sink's state.
    let slot: Arc<Mutex<Option<Engine>>> = Arc::new(Mutex::new(None));
    let gone = Arc::new(AtomicBool::new(false));
    let dropped = Arc::new(AtomicBool::new(false));
    let (in_sink, state, did) = (slot.clone(), Gone(gone.clone()), dropped.clone());
    let main = std::thread::current().id();
    let engine = Engine::open(config().log(LogLevel::Warn, move |_, _| {
        let _keep = &state;
        if std::thread::current().id() == main {
            return;
        }
        if let Some(e) = in_sink.lock().unwrap().take() {
            drop(e);
            did.store(true, Ordering::SeqCst);
        }
    }))
    .unwrap();
    *slot.lock().unwrap() = Some(engine);
    {
        let guard = slot.lock().unwrap();
        let e = guard.as_ref().unwrap();
        let blocks = e.prefix_lookup(&tokens).unwrap();
        assert_eq!(blocks.len(), 2);
        let raw: Vec<_> = blocks.iter().map(|b| b.block()).collect();
        let err = e.migrate(&raw, Tier::Host).unwrap().wait(None).unwrap_err();
        assert_eq!(err.status(), Status::Corrupt);
    }
    let start = Instant::now();
    while !dropped.load(Ordering::SeqCst) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the sink never ran"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !gone.load(Ordering::SeqCst),
        "the sink's state was freed while its engine runs"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn child_panic_with_guards_alive() {
    let e = common::small();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let s = e.create_sequence(0).unwrap();
        s.append(&[1; 16]).unwrap();
        common::fill(&e, &s, 2);
        let _hold = s.acquire(..).unwrap();
        let _fence = s.migrate(0..4, Tier::Host).unwrap();
        let _blk = e.alloc_block(0).unwrap();
        let _plan = e.attention_plan::<f32>(0, &[&s], None, None).unwrap();
        let _ctx = e.create_context("p", KvPolicy::Demote).unwrap();
        panic!("unwinding with every guard alive");
    }));
    assert!(r.is_err());
    // The engine is consistent afterwards: nothing held, nothing leaked.
    let dev = e.tier_info(Tier::Device).unwrap();
    assert_eq!(dev.pinned_blocks, 0);
    let s = e.create_sequence(0).unwrap();
    s.append(&[1; 16]).unwrap();
    assert!(s.acquire(..).is_ok());
}

// ------------------------------------------------------------ child tests

#[test]
fn huge_token_counts_are_errors_not_aborts() {
    common::child_passes(CHILD_VAR, "huge_read_kv_vec", None);
}

#[test]
fn empty_views_give_empty_slices() {
    common::child_passes(CHILD_VAR, "empty_view_slices", None);
}

#[test]
fn a_log_sink_dropping_its_engine_does_not_crash_or_hang() {
    common::child_passes(CHILD_VAR, "log_sink_drops_engine", None);
    common::child_passes(CHILD_VAR, "log_sink_drops_last_engine_on_worker", None);
}

#[test]
fn unwinding_with_guards_alive_leaves_the_engine_consistent() {
    common::child_passes(CHILD_VAR, "panic_with_guards_alive", None);
}

// ------------------------------------------------------------ in-process

#[test]
fn nul_bytes_in_strings_are_invalid_arg() {
    let e = common::small();
    let err = e.create_context("a\0b", KvPolicy::Keep).unwrap_err();
    assert_eq!(err.status(), Status::InvalidArg);
    let c = e.create_context("", KvPolicy::Keep).unwrap();
    let err = c.add_region_bytes("w\0", 0, &[1, 2, 3]).unwrap_err();
    assert_eq!(err.status(), Status::InvalidArg);
    let err = c
        .add_region_file("w", 0, std::path::Path::new("/tmp/a\0b"), 0, 1)
        .unwrap_err();
    assert_eq!(err.status(), Status::InvalidArg);
    // Size 0 is refused by the library.
    assert_eq!(
        c.add_region_bytes("w", 0, &[]).unwrap_err().status(),
        Status::InvalidArg
    );
    for cfg in [
        Config::new()
            .backend(Backend::Cpu)
            .disk("/tmp/x\0y", 1 << 20),
        Config::new().backend(Backend::Cpu).remote("a\0:1"),
        Config::new()
            .backend(Backend::Cpu)
            .remote("127.0.0.1:1")
            .remote_tls(Some("ca\0")),
    ] {
        assert_eq!(Engine::open(cfg).unwrap_err().status(), Status::InvalidArg);
    }
    // A pair with a NUL is skipped, as documented; a bad value is an error.
    let cfg = Config::new()
        .apply_vars([("KVH_HOST_BYTES", "1\0G")])
        .unwrap();
    assert_eq!(cfg.as_raw().host_bytes, Config::new().as_raw().host_bytes);
    let err = Config::new()
        .apply_vars([("KVH_HOST_BYTES", "lots")])
        .unwrap_err();
    assert_eq!(err.status(), Status::InvalidArg);
}

#[test]
fn kv_slices_of_every_wrong_shape_are_refused() {
    let e = common::small();
    let g = *e.geometry();
    let per = g.token_elems();
    let s = e.create_sequence(0).unwrap();
    s.append(&[1; 8]).unwrap();
    let k = vec![1f32; 8 * per];
    for (kl, vl) in [(per - 1, per - 1), (per, per + 1), (per + 1, per), (0, per)] {
        let err = s.write_kv(0, 0, &k[..kl], &k[..vl]).unwrap_err();
        assert_eq!(err.status(), Status::InvalidArg, "{kl} {vl}");
    }
    // Zero tokens: nothing to do, at any position inside or at the end.
    s.write_kv::<f32>(0, 8, &[], &[]).unwrap();
    // Past the end, even for zero tokens, is Range or nothing.
    if let Err(e) = s.write_kv::<f32>(0, 9, &[], &[]) {
        assert_eq!(e.status(), Status::Range);
    }
    // Unaligned f32 data: the slice is aligned by type, so the library
    // sees aligned memory; odd offsets into a byte buffer cannot be
    // expressed. Wrong element types are refused.
    let bits = vec![0u16; 8 * per];
    assert_eq!(
        s.write_kv(0, 0, &bits, &bits).unwrap_err().status(),
        Status::InvalidArg
    );
    let mut out16 = vec![0u16; per];
    assert_eq!(
        s.read_k(0, 0, &mut out16).unwrap_err().status(),
        Status::InvalidArg
    );
    let mut out = vec![0f32; per];
    // Never written: Range.
    assert_eq!(
        s.read_v(0, 0, &mut out).unwrap_err().status(),
        Status::Range
    );
    s.write_kv(0, 0, &k, &k).unwrap();
    let mut short = vec![0f32; per];
    let mut long = vec![0f32; 2 * per];
    assert_eq!(
        s.read_kv(0, 0, &mut short, &mut long).unwrap_err().status(),
        Status::InvalidArg
    );
    // Reading across the end.
    let mut nine = vec![0f32; 9 * per];
    assert_eq!(
        s.read_k(0, 0, &mut nine).unwrap_err().status(),
        Status::Range
    );
    // Token ids past the end.
    let mut ids = [0i32; 2];
    assert_eq!(
        s.tokens_into(7, &mut ids).unwrap_err().status(),
        Status::Range
    );
    assert_eq!(
        s.tokens_into(u64::MAX, &mut ids).unwrap_err().status(),
        Status::Range
    );
    s.tokens_into(u64::MAX, &mut []).unwrap_or(());
    let mut blocks = [kvh::Block::from_raw(Default::default()); 3];
    assert_eq!(
        s.blocks_into(0, &mut blocks).unwrap_err().status(),
        Status::Range
    );
    assert_eq!(
        s.blocks_into(u64::MAX, &mut blocks[..1])
            .unwrap_err()
            .status(),
        Status::Range
    );
}

#[test]
fn codec_buffers_of_wrong_sizes_are_refused() {
    let dim = 64u32;
    let src: Vec<f32> = (0..3 * dim as usize).map(|i| i as f32 * 0.01).collect();
    for c in [Codec::None, Codec::Int8, Codec::Q4G32, Codec::Q4G64] {
        let rec = codec::encode(c, DType::F32, dim, &src).unwrap();
        let vb = codec::vector_bytes(c, DType::F32, dim).unwrap();
        assert_eq!(rec.len(), 3 * vb);
        let mut dst = vec![0f32; src.len()];
        codec::decode(c, DType::F32, dim, &rec, &mut dst).unwrap();
        for bad in [0, rec.len() - 1, rec.len() + 1] {
            let mut big = rec.clone();
            big.resize(bad, 0);
            assert_eq!(
                codec::decode(c, DType::F32, dim, &big, &mut dst)
                    .unwrap_err()
                    .status(),
                Status::InvalidArg
            );
        }
        let mut partial = vec![0f32; src.len() - 1];
        assert!(codec::decode(c, DType::F32, dim, &rec, &mut partial).is_err());
        assert!(codec::encode(c, DType::F32, dim, &src[1..]).is_err());
        assert!(codec::encode(c, DType::F16, dim, &src).is_err());
        assert!(codec::encode::<u16>(c, DType::F32, dim, &[0; 64]).is_err());
        assert!(codec::encode(c, DType::F32, 0, &src).is_err());
        // Empty input: no vectors, no records.
        assert!(codec::encode::<f32>(c, DType::F32, dim, &[])
            .map(|r| r.is_empty())
            .unwrap_or(true));
        codec::decode::<f32>(c, DType::F32, dim, &[], &mut []).unwrap_or(());
        // Huge head_dim: sizes do not wrap.
        let _ = codec::vector_bytes(c, DType::F32, u32::MAX);
        let _ = codec::encode::<f32>(c, DType::F32, u32::MAX, &[]);
    }
}

#[test]
fn attention_with_bad_shapes_is_refused() {
    let e = common::small();
    let g = *e.geometry();
    let s = e.create_sequence(0).unwrap();
    s.append(&[1; 6]).unwrap();
    common::fill(&e, &s, 1);
    let per = g.token_elems();
    let q = vec![0.1f32; per];
    let mut out = vec![0f32; per];
    e.attention_decode(0, &[&s], &q, &mut out, None).unwrap();
    let mut short = vec![0f32; per - 1];
    assert_eq!(
        e.attention_decode(0, &[&s], &q, &mut short, None)
            .unwrap_err()
            .status(),
        Status::InvalidArg
    );
    assert!(e
        .attention_decode(u32::MAX, &[&s], &q, &mut out, None)
        .is_err());
    // Empty batch.
    let _ = e.attention_decode::<f32>(0, &[], &[], &mut [], None);
    for p in [
        AttentionParams {
            num_q_heads: 3,
            ..Default::default()
        },
        AttentionParams {
            num_q_heads: u32::MAX,
            ..Default::default()
        },
        AttentionParams {
            io_dtype: DType::F16,
            ..Default::default()
        },
        AttentionParams {
            scale: f32::NAN,
            stream_chunk_blocks: u32::MAX,
            stream_window_blocks: 1,
            ..Default::default()
        },
    ] {
        // f32 slices of the default shape: refused or computed, never
        // read past their ends.
        let r = e.attention_decode(0, &[&s], &q, &mut out, Some(&p));
        if p.num_q_heads != 0 || p.io_dtype != DType::F32 {
            assert!(r.is_err(), "{p:?}");
        }
    }
    // Prefill: q_lens longer than the sequence, and sums that overflow u32.
    let mut out6 = vec![0f32; 7 * per];
    let q6 = vec![0.1f32; 7 * per];
    assert!(e
        .attention_prefill(0, &[&s], &[7], &q6, &mut out6, None)
        .is_err());
    assert!(e
        .attention_prefill(0, &[&s, &s], &[u32::MAX, 1], &q6, &mut out6, None)
        .is_err());
    // No query token at all: nothing to compute.
    if let Err(err) = e.attention_prefill::<f32>(0, &[&s], &[0], &[], &mut [], None) {
        assert_ne!(err.status(), Status::Internal);
    }
    // A plan with a wrong element type or size.
    let plan = e.attention_plan::<f32>(0, &[&s], Some(&[2]), None).unwrap();
    let mut o2 = vec![0f32; 2 * per];
    plan.run(&q6[..2 * per], &mut o2).unwrap();
    assert!(plan.run(&q6[..per], &mut o2).is_err());
    let q16 = vec![0u16; 2 * per];
    let mut o16 = vec![0u16; 2 * per];
    assert!(plan.run(&q16, &mut o16).is_err());
    // q_lens not matching the batch.
    assert!(e
        .attention_plan::<f32>(0, &[&s], Some(&[1, 1]), None)
        .is_err());
    // A sequence of another engine.
    let other = common::small();
    let so = other.create_sequence(0).unwrap();
    assert!(e.attention_decode(0, &[&so], &q, &mut out, None).is_err());
    assert!(e.attention_plan::<f32>(0, &[&so], None, None).is_err());
    // As the library reports such a handle (Python and C agree).
    assert_eq!(
        e.attention_decode(0, &[&so], &q, &mut out, None)
            .unwrap_err()
            .status(),
        kvh::Status::BadHandle
    );
}

#[test]
fn handles_across_engines_are_refused() {
    let a = common::small();
    let b = common::small();
    let sa = a.create_sequence(0).unwrap();
    sa.append(&[1; 8]).unwrap();
    let sb = b.create_sequence(0).unwrap();
    sb.append(&[2; 8]).unwrap();
    let cb = b.create_context("b", KvPolicy::Demote).unwrap();
    // A's sequence attached to B's context: an error, and B's own
    // sequence (which may have the same handle value) is untouched.
    assert!(cb.attach(&sa).is_err());
    assert!(b.create_sequence_with(0, 0, Some(&cb)).is_ok());
    assert!(a.create_sequence_with(0, 0, Some(&cb)).is_err());
    // Forged block handles.
    for id in [0u64, 1, u64::MAX, sa.blocks().unwrap()[0].id()] {
        let blk = kvh::Block::from_raw(kvh::sys::kvh_block { id });
        assert!(b.block_info(blk).is_err());
        assert!(b.persist_blocks(&[blk]).is_err());
        if let Ok(f) = b.migrate(&[blk], Tier::Host) {
            assert!(f.wait(Some(Duration::from_secs(10))).is_err());
        }
    }
    // The other engine's sequence is intact.
    assert_eq!(sb.tokens().unwrap(), vec![2; 8]);
}

#[test]
fn a_hold_outliving_a_truncation_does_not_release_a_later_hold() {
    let e = common::engine(1, 1, 8, 4, 8, 64);
    let s = e.create_sequence(0).unwrap();
    s.append(&[1; 12]).unwrap();
    common::fill(&e, &s, 1);
    // Holds are named by their token range: truncating under a live one
    // and appending again would let its drop end a later hold of the same
    // range. The truncation is refused instead.
    let first = s.acquire(0..8).unwrap();
    for n in [0, 4, 7] {
        assert_eq!(s.truncate(n).unwrap_err().status(), Status::Busy, "{n}");
    }
    assert_eq!(s.len().unwrap(), 12);
    s.truncate(8).unwrap(); // past the hold: allowed
    drop(first);
    s.truncate(0).unwrap();
    s.append(&[2; 8]).unwrap();
    common::fill(&e, &s, 2);
    let second = s.acquire(0..8).unwrap();
    let (again, fence) = s.acquire_async(0..8).unwrap();
    fence.wait(None).unwrap();
    again.release().unwrap();
    assert_eq!(s.truncate(0).unwrap_err().status(), Status::Busy);
    let blocks = s.blocks().unwrap();
    s.migrate(.., Tier::Host).unwrap().wait(None).unwrap();
    for b in &blocks {
        let info = e.block_info(*b).unwrap();
        assert_eq!(info.tier, Some(Tier::Device));
        assert!(info.holds >= 1);
    }
    drop(second);
    // A forgotten hold keeps its range for good (a leak, not an error).
    std::mem::forget(s.acquire(4..8).unwrap());
    s.truncate(8).unwrap();
    assert_eq!(s.truncate(6).unwrap_err().status(), Status::Busy);
}

#[test]
fn a_view_slice_does_not_change_while_borrowed() {
    let e = common::vmap_engine();
    let s = e.create_sequence(0).unwrap();
    s.append(&[3; 24]).unwrap();
    let kv = vec![0.5f32; 24 * 128];
    s.write_kv(0, 0, &kv, &kv).unwrap();
    let view = match s.vmap(0, 64) {
        Ok(v) => v,
        Err(err) if err.status() == Status::Unsupported => return,
        Err(err) => panic!("vmap: {err}"),
    };
    let k: &[f32] = view.k(0).unwrap();
    // Safe code rewrites the tokens a shared slice shows, and truncates and
    // rewrites inside a mapped block. The partial last block is written in
    // place, under the slice: those writes are refused while the view
    // lives; tokens past the view are not.
    let other = vec![-7.0f32; 24 * 128];
    let busy = |r: kvh::Result<()>| assert_eq!(r.unwrap_err().status(), Status::Busy);
    busy(s.write_kv(0, 0, &other, &other));
    busy(s.write_kv(0, 23, &other[..128], &other[..128]));
    s.truncate(20).unwrap();
    s.append(&[4; 4]).unwrap();
    busy(s.write_kv(0, 20, &other[..4 * 128], &other[..4 * 128]));
    s.append(&[5; 4]).unwrap();
    s.write_kv(0, 24, &other[..4 * 128], &other[..4 * 128])
        .unwrap();
    let seen: Vec<f32> = k.iter().map(|x| std::hint::black_box(*x)).collect();
    assert!(
        seen.iter().all(|&x| x == 0.5),
        "a &[f32] changed while borrowed"
    );
    drop(view);
    s.write_kv(0, 0, &other, &other).unwrap();
    let (k2, _) = s.read_kv_vec::<f32>(0, 0, 1).unwrap();
    assert!(k2.iter().all(|&x| x == -7.0));
}

#[test]
fn forgotten_batches_views_and_plans_then_close() {
    const L: u32 = 2;
    const H: u32 = 2;
    const D: u32 = 4;
    const BT: u32 = 4;
    const SLOTS: u32 = 4;
    let slot_elems = (BT * H * D) as usize;
    // Leaked on purpose: forgotten batches may write into it at close.
    let k: &'static mut [Vec<f32>] = Box::leak(
        (0..L)
            .map(|_| vec![1f32; slot_elems * SLOTS as usize])
            .collect::<Vec<_>>()
            .into_boxed_slice(),
    );
    let v: &'static mut [Vec<f32>] = Box::leak(
        (0..L)
            .map(|_| vec![2f32; slot_elems * SLOTS as usize])
            .collect::<Vec<_>>()
            .into_boxed_slice(),
    );
    let kp: Vec<*mut c_void> = k.iter_mut().map(|x| x.as_mut_ptr().cast()).collect();
    let vp: Vec<*mut c_void> = v.iter_mut().map(|x| x.as_mut_ptr().cast()).collect();
    for round in 0..3 {
        let e = common::engine(L, H, D, BT, 16, 16);
        // SAFETY: the memory is leaked, so valid for ever; nothing else
        // touches it.
        let pool = unsafe {
            Pool::register(
                &e,
                &kp,
                &vp,
                SLOTS,
                slot_elems as u64 * 4,
                u64::from(H * D) * 4,
                u64::from(D) * 4,
            )
        }
        .unwrap();
        let toks: Vec<Vec<i32>> = (0..SLOTS as i32)
            .map(|i| (0..BT as i32).map(|t| 10 * i + t + round).collect())
            .collect();
        let mut parent = 0u64;
        let mut items = Vec::new();
        for (i, t) in toks.iter().enumerate() {
            items.push(OffloadItem {
                slot: i as u32,
                scope: 0,
                parent_hash: parent,
                tokens: t,
            });
            parent = e.prefix_hash(parent, t).unwrap();
        }
        // Misuse first: each refused with nothing queued.
        let mut dup = items.clone();
        dup[1].slot = 0;
        assert_eq!(
            pool.offload_batch(&dup, 0).unwrap_err().status(),
            Status::InvalidArg
        );
        let mut far = items.clone();
        far[0].slot = SLOTS;
        assert_eq!(
            pool.offload_batch(&far, 0).unwrap_err().status(),
            Status::Range
        );
        let mut short = items.clone();
        short[2].tokens = &toks[2][..1];
        assert_eq!(
            pool.offload_batch(&short, 0).unwrap_err().status(),
            Status::InvalidArg
        );
        let empty = pool.offload_batch(&[], 0).unwrap();
        empty.wait(None).unwrap();
        assert!(empty.statuses().unwrap().is_empty());
        drop(empty);

        let batch = pool.offload_batch(&items, 0).unwrap();
        let blocks: Vec<kvh::Block> = batch.blocks().iter().map(|b| b.block()).collect();
        let pairs: Vec<(kvh::Block, u32)> = blocks.iter().map(|b| (*b, 0)).collect();
        // Restores: zero layers, layers past the end, a slot twice.
        batch.wait(None).unwrap();
        assert!(pool.restore_batch(&pairs[..1], 0, 0).is_err());
        assert_eq!(
            pool.restore_batch(&pairs[..1], L, 1).unwrap_err().status(),
            Status::Range
        );
        assert_eq!(
            pool.restore_batch(&pairs[..1], u32::MAX, 2)
                .unwrap_err()
                .status(),
            Status::Range
        );
        assert!(pool.restore_batch(&pairs[..2], 0, L).is_err());
        let restore = pool.restore_batch(&pairs[..1], 0, L).unwrap();
        assert!(restore.wait_layer(L, None).is_err());
        assert!(restore.wait_layer(u32::MAX, None).is_err());

        let s = e.create_sequence(0).unwrap();
        s.append(&[5; 9]).unwrap();
        common::fill(&e, &s, 5);
        let plan = e.attention_plan::<f32>(1, &[&s], None, None).unwrap();
        let hold = s.acquire(..).unwrap();
        match round {
            0 => {
                std::mem::forget(batch);
                std::mem::forget(restore);
                std::mem::forget(plan);
                std::mem::forget(hold);
                drop(s);
                drop(pool);
            }
            1 => {
                drop(pool); // while the batches are alive
                std::mem::forget(hold);
                drop((batch, restore, plan)); // the plan borrows s
                drop(s);
            }
            _ => {
                std::mem::forget(pool);
                drop((batch, restore, plan, hold));
                std::mem::forget(s);
            }
        }
        let _ = e.stats().unwrap();
        drop(e);
    }
}

#[test]
fn a_context_dropped_while_its_switch_runs() {
    let e = common::context_engine();
    for _ in 0..5 {
        let a = e.create_context("a", KvPolicy::Demote).unwrap();
        let b = e.create_context("b", KvPolicy::Keep).unwrap();
        for l in 0..4 {
            a.add_region_bytes("w", l, &[l as u8; 30_000]).unwrap();
            b.add_region_bytes("w", l, &[9; 20_000]).unwrap();
        }
        let s = e.create_sequence_with(0, 0, Some(&a)).unwrap();
        s.append(&[1; 20]).unwrap();
        a.attach(&s).unwrap();
        let f1 = e.switch_context_async(None, Some(&a)).unwrap();
        drop(a); // Busy inside: left to close, or destroyed
        let f2 = e.switch_context_async(None, Some(&b)).unwrap();
        drop(s);
        let _ = f1.wait(Some(Duration::from_secs(10)));
        f2.wait(Some(Duration::from_secs(10))).unwrap();
        assert_eq!(b.region_bytes(3).unwrap(), vec![9; 20_000]);
        drop(b);
        drop((f1, f2));
    }
    let _ = e.weight_stats().unwrap();
}

#[test]
fn engine_closed_from_another_thread_after_its_users() {
    // The last Arc is dropped on whichever thread ends last: close runs
    // there, after every handle of every thread was freed.
    for _ in 0..4 {
        let engine = Arc::new(common::small());
        let mut threads = Vec::new();
        for t in 0..3u32 {
            let e = engine.clone();
            threads.push(std::thread::spawn(move || {
                let s = e.create_sequence(t).unwrap();
                s.append(&[t as i32; 40]).unwrap();
                common::fill(&e, &s, t);
                let f = s.migrate(.., Tier::Host).unwrap();
                let b = e.alloc_block(t).unwrap();
                let b2 = b.try_clone().unwrap();
                std::thread::scope(|sc| {
                    sc.spawn(|| drop(b2));
                    sc.spawn(|| f.wait(None));
                });
                drop(b);
                let shared = s.shared();
                std::thread::scope(|sc| {
                    sc.spawn(move || shared.prefetch(.., 1));
                    sc.spawn(move || shared.hint(0..4, 3));
                });
                drop(s);
            }));
        }
        drop(engine);
        for t in threads {
            t.join().unwrap();
        }
    }
}

#[test]
fn fences_shared_between_threads_and_waited_together() {
    let e = common::engine(2, 2, 8, 4, 8, 128);
    let s = e.create_sequence(0).unwrap();
    s.append(&[1; 128]).unwrap();
    common::fill(&e, &s, 1);
    let f = s.migrate(.., Tier::Host).unwrap();
    std::thread::scope(|sc| {
        for _ in 0..4 {
            let f = &f;
            sc.spawn(move || {
                f.wait(Some(Duration::MAX)).unwrap();
                assert!(f.poll().unwrap());
            });
        }
    });
    f.wait(Some(Duration::ZERO)).unwrap();
    let blocks: Vec<_> = s.blocks().unwrap();
    let held: Vec<_> = blocks
        .iter()
        .map(|b| e.block_info(*b).unwrap().tier)
        .collect();
    assert!(held.iter().all(|t| t.is_some()));
}

#[test]
fn scopes_and_hints_at_the_limits() {
    let e = common::small();
    let s = e.create_sequence(0).unwrap();
    s.set_scope(Scope::with_shared(u64::MAX, u64::MAX, u64::MAX))
        .unwrap_or(());
    s.append(&[1; 8]).unwrap();
    assert_eq!(
        s.set_scope(Scope::new(1)).unwrap_err().status(),
        Status::InvalidArg
    );
    assert!(s.hint_at_position(.., 1 << 24).is_err());
    assert!(s.hint_for_request(.., u64::MAX).is_ok() || s.hint_for_request(.., u64::MAX).is_err());
    assert!(s.hint(0..9, i32::MAX).is_err());
    assert!(e.prefix_hash(0, &[1, 2, 3]).is_err());
    assert!(e.prefix_hash(0, &[]).is_err());
    assert!(e.prefix_lookup(&[]).unwrap().is_empty());
    assert!(e
        .prefix_lookup_scoped(Scope::new(u64::MAX), &[1; 3])
        .unwrap()
        .is_empty());
    let m = e.create_sequence(0).unwrap();
    assert_eq!(m.match_prefix(&[]).unwrap(), 0);
    // Not empty any more after a match of nothing? Still empty.
    assert_eq!(m.match_prefix(&[1; 3]).unwrap(), 0);
    assert!(e.block_table(&[]).unwrap().is_empty());
    let t = e.block_table(&[&s, &s]).unwrap();
    assert_eq!(t.len(), 2);
}
