//! More of a hostile user of the safe API: every case compiles without
//! `unsafe` (except registering pool memory, whose contract is kept) and
//! must end in `Ok` or an `Err` of the documented kind: never a crash, a
//! hang, an abort, a shared slice changing under its borrow, or bytes that
//! differ from what was written. Cases that could take the process down
//! run in a child process (this binary re-run with `KVH_HOSTILE_MORE_CHILD`
//! naming the case), so a crash fails only that test.

mod common;

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvh::{
    AttentionParams, Backend, Block, Config, DType, Engine, KvPolicy, LogLevel, OffloadItem, Pool,
    Status, Tier,
};

const CHILD_VAR: &str = "KVH_HOSTILE_MORE_CHILD";

/// The cases run in a child process, by name.
const CHILD_CASES: &[(&str, fn())] = &[
    ("panic_payload_drop_panics", child_panic_payload_drop_panics),
    ("restore_huge_n_layers", child_restore_huge_n_layers),
];

/// Entry of the child process: runs the case named by the variable
/// (nothing in a normal run).
#[test]
fn child_entry() {
    common::run_child_case(CHILD_VAR, CHILD_CASES);
}

// ---------------------------------------------------------------- children

/// A panic payload whose own drop panics.
struct Bomb;

impl Drop for Bomb {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            panic!("the payload's drop panics too");
        }
    }
}

fn child_panic_payload_drop_panics() {
    // Silence the two panic messages per call.
    std::panic::set_hook(Box::new(|_| {}));
    let calls = Arc::new(AtomicU32::new(0));
    let seen = calls.clone();
    let engine = Engine::open(
        Config::new()
            .backend(Backend::Auto)
            .dtype(DType::F32)
            .head_dim(8)
            .device_bytes(1 << 20)
            .host_bytes(1 << 20)
            .log(LogLevel::Debug, move |_, _| {
                seen.fetch_add(1, Ordering::SeqCst);
                std::panic::panic_any(Bomb);
            }),
    )
    .unwrap();
    let seq = engine.create_sequence(0).unwrap();
    seq.append(&[1; 16]).unwrap();
    // Errors are logged at debug level on this thread.
    assert!(seq.acquire(0..1000).is_err());
    assert!(seq.tokens_into(1000, &mut [0; 4]).is_err());
    drop(seq);
    drop(engine);
    assert!(calls.load(Ordering::SeqCst) > 0, "the sink never ran");
}

fn child_restore_huge_n_layers() {
    const L: u32 = 2;
    const H: u32 = 1;
    const D: u32 = 4;
    const BT: u32 = 4;
    let e = common::engine(L, H, D, BT, 16, 16);
    let slot_elems = (BT * H * D) as usize;
    let mut k: Vec<Vec<f32>> = (0..L).map(|_| vec![0f32; slot_elems * 2]).collect();
    let mut v: Vec<Vec<f32>> = (0..L).map(|_| vec![0f32; slot_elems * 2]).collect();
    let kp: Vec<*mut c_void> = k.iter_mut().map(|x| x.as_mut_ptr().cast()).collect();
    let vp: Vec<*mut c_void> = v.iter_mut().map(|x| x.as_mut_ptr().cast()).collect();
    let row = u64::from(D) * 4;
    // SAFETY: the vectors outlive the pool and nothing else touches them
    // while a batch runs.
    let pool = unsafe {
        Pool::register(
            &e,
            &kp,
            &vp,
            2,
            slot_elems as u64 * 4,
            u64::from(H) * row,
            row,
        )
    }
    .unwrap();
    // Layers past num_layers are a Range error (kvh.h), whatever the count:
    // never an allocation of one fence per requested layer.
    for (first, n) in [(0, u32::MAX), (1, u32::MAX), (u32::MAX, 1), (0, L + 1)] {
        match pool.restore_batch(&[], first, n) {
            Ok(_) => panic!("restore of layers {first}+{n} accepted"),
            Err(err) => assert!(
                matches!(err.status(), Status::Range | Status::InvalidArg),
                "{first}+{n}: {err}"
            ),
        }
    }
    drop(pool);
    drop((k, v));
}

// ------------------------------------------------------------ child tests

#[test]
fn a_log_sink_panicking_with_a_panicking_payload_does_not_abort() {
    common::child_passes(CHILD_VAR, "panic_payload_drop_panics", None);
}

#[test]
fn restore_batch_with_huge_layer_counts_is_an_error_not_an_abort() {
    // 4 GiB of address space: one fence per layer of u32::MAX layers
    // (32 GiB) cannot be had, so an unchecked count aborts the child
    // instead of taking the machine's memory.
    common::child_passes(CHILD_VAR, "restore_huge_n_layers", Some(4 << 20));
}

// ------------------------------------------------------------------ views

/// A view of a 24-token sequence (a full block and a partial one) filled
/// with 0.5, or None where this machine cannot map views.
fn view_setup(e: &Engine) -> Option<(kvh::Sequence<'_>, kvh::VMap<'_>)> {
    let s = e.create_sequence(0).unwrap();
    s.append(&[3; 24]).unwrap();
    let kv = vec![0.5f32; 24 * 128];
    s.write_kv(0, 0, &kv, &kv).unwrap();
    match s.vmap(0, 64) {
        Ok(v) => Some((s, v)),
        Err(err) if err.status() == Status::Unsupported => None,
        Err(err) => panic!("vmap: {err}"),
    }
}

#[test]
fn a_view_slice_is_stable_when_a_fork_writes_after_its_parent_is_truncated() {
    let e = common::vmap_engine();
    let Some((parent, view)) = view_setup(&e) else {
        return;
    };
    let k: &[f32] = view.k(0).unwrap();
    let v: &[f32] = view.v(1).unwrap();
    assert_eq!(k.len(), 24 * 64);
    let child = parent.fork(1).unwrap();
    // The parent gives up its tokens (no hold: only the view maps them),
    // leaving the fork the only owner of the partial block the view maps.
    if let Err(err) = parent.truncate(0) {
        assert_eq!(err.status(), Status::Busy, "{err}");
    }
    // The fork rewrites the tokens of that partial block: it must get a
    // copy (or be refused), not write the pages the view shows.
    let other = vec![-7.0f32; 8 * 128];
    match child.write_kv(0, 16, &other, &other) {
        Ok(()) => {}
        Err(err) => assert_eq!(err.status(), Status::Busy, "{err}"),
    }
    let seen_k: Vec<f32> = k.iter().map(|x| std::hint::black_box(*x)).collect();
    let seen_v: Vec<f32> = v.iter().map(|x| std::hint::black_box(*x)).collect();
    let changed = seen_k.iter().chain(&seen_v).filter(|&&x| x != 0.5).count();
    assert_eq!(
        changed, 0,
        "{changed} elements of a borrowed &[f32] of the view changed"
    );
    // What the fork wrote is what it reads.
    let (k2, v2) = child.read_kv_vec::<f32>(0, 16, 8).unwrap();
    assert!(k2.iter().chain(&v2).all(|&x| x == -7.0));
    drop(view);
}

#[test]
fn a_view_slice_is_stable_when_a_fork_writes_after_its_parent_is_dropped() {
    let e = common::vmap_engine();
    let Some((parent, view)) = view_setup(&e) else {
        return;
    };
    let k: &[f32] = view.k(1).unwrap();
    let child = parent.fork(1).unwrap();
    // The view borrows only the engine: its sequence can be freed.
    drop(parent);
    let other = vec![-7.0f32; 8 * 128];
    match child.write_kv(0, 16, &other, &other) {
        Ok(()) => {}
        Err(err) => assert_eq!(err.status(), Status::Busy, "{err}"),
    }
    let changed = k
        .iter()
        .map(|x| std::hint::black_box(*x))
        .filter(|&x| x != 0.5)
        .count();
    assert_eq!(
        changed, 0,
        "{changed} elements of a borrowed &[f32] of the view changed"
    );
    drop(view);
}

// ------------------------------------------------------------- bit-exact

/// Every 16-bit pattern class that a lossy path would change: NaNs with
/// payloads (quiet and signalling), infinities, subnormals, -0.
fn odd_u16(n: usize) -> Vec<u16> {
    let specials = [
        0x0000u16, 0x8000, 0x0001, 0x8001, 0x03ff, 0x7c00, 0xfc00, 0x7c01, 0x7dff, 0x7e00, 0xfe01,
        0x7f80, 0xff80, 0x7f81, 0x7fc1, 0xffff, 0x3c00, 0xabcd,
    ];
    (0..n)
        .map(|i| {
            if i % 3 == 0 {
                specials[(i / 3) % specials.len()]
            } else {
                (i as u16).wrapping_mul(40503).rotate_left(i as u32 % 16)
            }
        })
        .collect()
}

#[test]
fn sixteen_bit_kv_is_bit_exact_through_tiers_and_forks() {
    for dtype in [DType::F16, DType::Bf16] {
        let e = Engine::open(
            Config::new()
                .backend(Backend::Cpu)
                .dtype(dtype)
                .num_layers(2)
                .num_kv_heads(2)
                .head_dim(8)
                .block_tokens(4)
                .device_bytes(1 << 20)
                .host_bytes(1 << 20),
        )
        .unwrap();
        let per = e.geometry().token_elems();
        let s = e.create_sequence(0).unwrap();
        s.append(&(0..10).collect::<Vec<i32>>()).unwrap();
        let k = odd_u16(10 * per);
        let v: Vec<u16> = k.iter().map(|x| !x).collect();
        for layer in 0..2 {
            s.write_kv(layer, 0, &k, &v).unwrap();
        }
        // f32 slices are refused for 16-bit data, before any FFI call.
        let mut f = vec![0f32; per];
        assert_eq!(
            s.read_k(0, 0, &mut f).unwrap_err().status(),
            Status::InvalidArg
        );
        let check = |seq: &kvh::Sequence<'_>, what: &str| {
            for layer in 0..2 {
                let (k2, v2) = seq.read_kv_vec::<u16>(layer, 0, 10).unwrap();
                assert!(k2 == k && v2 == v, "{dtype:?} {what} layer {layer}");
                let mut only_v = vec![0u16; 3 * per];
                seq.read_v(layer, 7, &mut only_v).unwrap();
                assert_eq!(only_v, v[7 * per..], "{dtype:?} {what} read_v");
            }
        };
        check(&s, "written");
        s.migrate(.., Tier::Host).unwrap().wait(None).unwrap();
        check(&s, "in the host tier");
        drop(s.acquire(..).unwrap());
        check(&s, "back in the device tier");
        let child = s.fork(1).unwrap();
        child.write_kv(1, 9, &k[..per], &v[..per]).unwrap();
        check(&s, "after the fork's write");
        let (k3, _) = child.read_kv_vec::<u16>(1, 9, 1).unwrap();
        assert_eq!(k3, k[..per]);
        let (k4, _) = child.read_kv_vec::<u16>(0, 0, 10).unwrap();
        assert_eq!(k4, k);
    }
}

#[test]
fn f32_nan_payloads_are_bit_exact_through_tiers() {
    let e = common::small();
    let per = e.geometry().token_elems();
    let s = e.create_sequence(0).unwrap();
    s.append(&[9; 6]).unwrap();
    let bits: Vec<u32> = (0..6 * per as u32)
        .map(|i| match i % 5 {
            0 => 0x7f80_0001 + i, // signalling NaN with payload
            1 => 0xffc0_0000 | i, // negative quiet NaN with payload
            2 => 0x0000_0001 + i, // subnormal
            3 => 0x8000_0000,     // -0
            _ => i.wrapping_mul(2_654_435_761),
        })
        .collect();
    let k: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
    let v: Vec<f32> = bits.iter().map(|&b| f32::from_bits(!b)).collect();
    s.write_kv(1, 0, &k, &v).unwrap();
    for step in 0..3 {
        let (k2, v2) = s.read_kv_vec::<f32>(1, 0, 6).unwrap();
        let kb: Vec<u32> = k2.iter().map(|x| x.to_bits()).collect();
        let vb: Vec<u32> = v2.iter().map(|x| x.to_bits()).collect();
        assert_eq!(kb, bits, "K bits, step {step}");
        assert!(
            vb.iter().zip(&bits).all(|(a, b)| *a == !b),
            "V bits, step {step}"
        );
        let tier = if step % 2 == 0 {
            Tier::Host
        } else {
            Tier::Device
        };
        s.migrate(.., tier).unwrap().wait(None).unwrap();
    }
}

// ------------------------------------------------------ zero and extremes

#[test]
fn zero_lengths_and_extreme_positions_are_ok_or_documented_errors() {
    let e = common::small();
    let s = e.create_sequence(0).unwrap();
    let range_or_ok = |r: kvh::Result<()>, what: &str| {
        if let Err(err) = r {
            assert!(
                matches!(err.status(), Status::Range | Status::InvalidArg),
                "{what}: {err}"
            );
        }
    };
    s.append(&[]).unwrap();
    assert_eq!(s.len().unwrap(), 0);
    assert_eq!(s.tokens().unwrap(), Vec::<i32>::new());
    assert_eq!(s.blocks().unwrap(), Vec::<Block>::new());
    s.append(&[1; 5]).unwrap();
    // n = 0 at, past and far past the end.
    for pos in [0, 5, 6, u64::MAX] {
        range_or_ok(s.write_kv::<f32>(0, pos, &[], &[]), "write_kv n=0");
        range_or_ok(s.read_kv::<f32>(0, pos, &mut [], &mut []), "read_kv n=0");
        range_or_ok(s.tokens_into(pos, &mut []), "tokens_into n=0");
        range_or_ok(s.blocks_into(pos, &mut []), "blocks_into n=0");
    }
    // One token at the largest positions.
    let one = vec![0f32; e.geometry().token_elems()];
    let mut out = one.clone();
    for pos in [u64::MAX, u64::MAX - 1, 1 << 63, u64::from(u32::MAX) + 1] {
        assert_eq!(
            s.write_kv(0, pos, &one, &one).unwrap_err().status(),
            Status::Range,
            "write at {pos}"
        );
        assert_eq!(
            s.read_k(0, pos, &mut out).unwrap_err().status(),
            Status::Range,
            "read at {pos}"
        );
        assert_eq!(
            s.tokens_into(pos, &mut [0; 1]).unwrap_err().status(),
            Status::Range
        );
        assert!(s.read_kv_vec::<f32>(0, pos, 1).is_err());
        assert!(s.read_kv_vec::<f32>(0, pos, usize::MAX).is_err());
    }
    // Layers past the model.
    for layer in [2, u32::MAX] {
        assert!(s.write_kv(layer, 0, &one, &one).is_err());
        assert!(s.read_k(layer, 0, &mut out).is_err());
    }
    // Ranges that overflow, are reversed or pass the end.
    #[allow(clippy::reversed_empty_ranges)]
    {
        assert_eq!(s.pin(3..1).unwrap_err().status(), Status::Range);
    }
    assert_eq!(
        s.prefetch(u64::MAX.., 0).unwrap_err().status(),
        Status::Range
    );
    assert!(s.acquire(0..=u64::MAX).is_err());
    assert!(s.migrate(4..u64::MAX, Tier::Host).is_err());
    assert!(s.hint(..=u64::MAX, 1).is_err());
    assert_eq!(s.truncate(6).unwrap_err().status(), Status::Range);
    s.truncate(5).unwrap();
    // Empty batches.
    assert_eq!(e.block_table(&[]).unwrap().indptr, vec![0]);
    e.migrate(&[], Tier::Host).unwrap().wait(None).unwrap();
    assert_eq!(e.prefix_lookup(&[]).unwrap().len(), 0);
    assert_eq!(e.prefix_lookup(&[1, 2, 3]).unwrap().len(), 0);
    let empty = e.create_sequence(0).unwrap();
    assert_eq!(empty.match_prefix(&[]).unwrap(), 0);
    let mut nothing: [f32; 0] = [];
    match e.attention_decode::<f32>(0, &[], &[], &mut nothing, None) {
        Ok(()) => {}
        Err(err) => assert!(
            matches!(err.status(), Status::InvalidArg | Status::Unsupported),
            "{err}"
        ),
    }
    // Prefix hashes of the wrong number of tokens.
    assert_eq!(
        e.prefix_hash(0, &[1, 2, 3]).unwrap_err().status(),
        Status::InvalidArg
    );
    assert_eq!(
        e.prefix_hash(0, &[]).unwrap_err().status(),
        Status::InvalidArg
    );
    // Timeouts at both extremes on a finished fence.
    let f = s.migrate(.., Tier::Host).unwrap();
    f.wait(Some(Duration::MAX)).unwrap();
    f.wait(Some(Duration::ZERO)).unwrap();
    f.wait(None).unwrap();
    assert!(f.poll().unwrap());
    // The hint step count at its limit.
    e.hint_advance(u64::MAX - e.hint_advance(0).unwrap())
        .unwrap();
    assert_eq!(e.hint_advance(1).unwrap_err().status(), Status::Range);
    assert_eq!(e.hint_advance(0).unwrap(), u64::MAX);
}

#[test]
fn attention_plan_with_huge_q_lens_is_an_error_not_a_panic() {
    let e = common::small();
    let s = e.create_sequence(0).unwrap();
    s.append(&[1; 8]).unwrap();
    common::fill(&e, &s, 1);
    let p = AttentionParams {
        num_q_heads: 2,
        ..Default::default()
    };
    for lens in [[u32::MAX], [9], [0]] {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            e.attention_plan::<f32>(0, &[&s], Some(&lens), Some(&p))
                .map(|plan| {
                    let mut out = vec![0f32; 16];
                    plan.run(&[0f32; 16], &mut out)
                })
        }));
        match r {
            Err(_) => panic!("q_lens {lens:?}: a panic, not an Err"),
            Ok(Ok(Ok(()))) => assert!(lens[0] <= 8, "q_lens {lens:?} ran"),
            Ok(Ok(Err(err))) | Ok(Err(err)) => assert!(
                matches!(
                    err.status(),
                    Status::Range | Status::InvalidArg | Status::Unsupported
                ),
                "q_lens {lens:?}: {err}"
            ),
        }
    }
    // Prefill with lengths whose product with the row size overflows.
    let mut out = [0f32; 4];
    let err = e
        .attention_prefill(
            0,
            &[&s, &s],
            &[u32::MAX, u32::MAX],
            &[0f32; 4],
            &mut out,
            None,
        )
        .unwrap_err();
    assert_eq!(err.status(), Status::InvalidArg);
}

// --------------------------------------------------------- across engines

#[test]
fn handles_of_another_engine_are_refused_everywhere() {
    let a = common::small();
    let b = common::small();
    // The first objects of two fresh engines: the raw values are as alike
    // as they get.
    let sa = a.create_sequence(0).unwrap();
    let sb = b.create_sequence(0).unwrap();
    sa.append(&[1; 8]).unwrap();
    sb.append(&[2; 8]).unwrap();
    common::fill(&a, &sa, 1);
    common::fill(&b, &sb, 2);
    let ca = a.create_context("a", KvPolicy::Demote).unwrap();
    // A context of engine a attaching a sequence of engine b.
    assert!(ca.attach(&sb).is_err(), "a foreign sequence was attached");
    let blocks_b = sb.blocks().unwrap();
    let blocks_a = sa.blocks().unwrap();
    for blk in &blocks_b {
        assert_eq!(
            a.block_info(*blk).unwrap_err().status(),
            Status::BadHandle,
            "a reads b's block"
        );
    }
    assert!(a.migrate(&blocks_b, Tier::Host).is_err());
    assert!(a.persist_blocks(&blocks_b).is_err());
    // Sequences of both in one batch.
    assert_eq!(
        a.block_table(&[&sa, &sb]).unwrap_err().status(),
        Status::BadHandle
    );
    // Forged handles.
    for raw in [
        0u64,
        1,
        u64::MAX,
        blocks_a[0].id() ^ 1,
        blocks_a[0].id() + (1 << 32),
    ] {
        let forged = Block::from_raw(kvh::sys::kvh_block { id: raw });
        if blocks_a.iter().any(|b| b.id() == forged.id()) {
            continue; // names a live block of a after all
        }
        assert!(a.block_info(forged).is_err(), "forged block {raw:#x}");
    }
    // Nothing changed on either side.
    let (k, _) = sa.read_kv_vec::<f32>(0, 0, 8).unwrap();
    assert_eq!(k, common::kv(&a, 1, 0, 0, 8).0);
    let (k, _) = sb.read_kv_vec::<f32>(1, 0, 8).unwrap();
    assert_eq!(k, common::kv(&b, 2, 1, 0, 8).0);
    assert_eq!(a.tier_info(Tier::Device).unwrap().used_blocks, 2);
    assert_eq!(b.tier_info(Tier::Device).unwrap().used_blocks, 2);
}

// ---------------------------------------------------------------- threads

#[test]
fn shared_views_race_the_owner_and_the_data_stays_exact() {
    let e = common::engine(1, 2, 8, 4, 16, 256);
    let s = e.create_sequence(0).unwrap();
    s.append(&[1; 64]).unwrap();
    common::fill(&e, &s, 3);
    let shared = s.shared();
    let stop = AtomicBool::new(false);
    std::thread::scope(|sc| {
        for t in 0..3 {
            let stop = &stop;
            sc.spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let len = shared.len().unwrap();
                    let _ = shared.prefetch(..len, t);
                    let _ = shared.hint(0..len.min(8), 1);
                    let tier = if i % 2 == 0 { Tier::Host } else { Tier::Device };
                    match shared.migrate(0..len, tier) {
                        Ok(f) => {
                            let _ = f.wait(Some(Duration::from_secs(5)));
                        }
                        Err(err) => assert!(
                            matches!(err.status(), Status::Range | Status::NoSpace | Status::Busy),
                            "{err}"
                        ),
                    }
                    i += 1;
                }
            });
        }
        // The owner keeps growing, shrinking and rewriting meanwhile.
        for round in 0..40u32 {
            s.truncate(32).unwrap();
            s.append(&[2; 32]).unwrap();
            let (k, v) = common::kv(&e, round, 0, 32, 32);
            s.write_kv(0, 32, &k, &v).unwrap();
            let (k2, v2) = s.read_kv_vec::<f32>(0, 32, 32).unwrap();
            assert!(k == k2 && v == v2, "round {round}: wrong data back");
        }
        stop.store(true, Ordering::Relaxed);
    });
    let (k, v) = s.read_kv_vec::<f32>(0, 0, 32).unwrap();
    assert_eq!((k, v), common::kv(&e, 3, 0, 0, 32));
}

#[test]
fn owned_blocks_cloned_and_released_on_many_threads_balance() {
    let e = common::small();
    let s = e.create_sequence(0).unwrap();
    let prompt: Vec<i32> = (0..8).collect();
    s.append(&prompt).unwrap();
    common::fill(&e, &s, 1);
    let held = e.prefix_lookup(&prompt).unwrap();
    assert_eq!(held.len(), 2);
    let base: Vec<u32> = held.iter().map(|b| b.info().unwrap().refs).collect();
    std::thread::scope(|sc| {
        for _ in 0..4 {
            let held = &held;
            sc.spawn(move || {
                for i in 0..200 {
                    let b = &held[i % 2];
                    let c = b.try_clone().unwrap();
                    c.set_pinned(true).unwrap();
                    c.set_pinned(false).unwrap();
                    if i % 3 == 0 {
                        c.release().unwrap();
                    } else {
                        drop(c);
                    }
                }
            });
        }
    });
    let after: Vec<u32> = held.iter().map(|b| b.info().unwrap().refs).collect();
    assert_eq!(base, after, "references leaked or lost");
    for b in &held {
        assert_eq!(b.info().unwrap().pins, 0);
    }
    // Releasing ours and the sequence's leaves blocks that may stay cached
    // but are referenced by nobody.
    let ids: Vec<Block> = held.iter().map(|b| b.block()).collect();
    for b in held {
        b.release().unwrap();
    }
    drop(s);
    for b in ids {
        if let Ok(info) = e.block_info(b) {
            assert_eq!(info.refs, 0);
        }
    }
}

#[test]
fn contexts_race_switches_on_other_threads_with_their_fences() {
    let e = common::context_engine();
    let data: Vec<u8> = (0..50_000u32).map(|i| (i * 7 % 253) as u8).collect();
    let a = e.create_context("a", KvPolicy::Keep).unwrap();
    let b = e.create_context("b", KvPolicy::Demote).unwrap();
    a.add_region_bytes("w", 0, &data).unwrap();
    b.add_region_bytes("w", 0, &data[..20_000]).unwrap();
    let seq = e.create_sequence_with(0, 0, Some(&b)).unwrap();
    seq.append(&[4; 16]).unwrap();
    common::fill(&e, &seq, 4);
    let fences = Mutex::new(Vec::new());
    for round in 0..20 {
        let (from, to) = if round % 2 == 0 {
            (Some(&b), &a)
        } else {
            (Some(&a), &b)
        };
        let f = e.switch_context_async(if round == 0 { None } else { from }, Some(to));
        let f = f.unwrap();
        // Another thread waits on the fence while this one reads the
        // destination's bytes once its layer 0 is in.
        std::thread::scope(|sc| {
            sc.spawn(|| f.wait(Some(Duration::from_secs(10))).unwrap());
            to.wait_layer(0, Some(Duration::from_secs(10))).unwrap();
        });
        let want = if std::ptr::eq(to, &a) {
            &data[..]
        } else {
            &data[..20_000]
        };
        assert_eq!(to.region_bytes(0).unwrap(), want, "round {round}");
        fences.lock().unwrap().push(f);
    }
    drop(fences);
    // The sequence of the demoted context came back intact.
    let (k, v) = seq.read_kv_vec::<f32>(0, 0, 16).unwrap();
    assert_eq!((k, v), common::kv(&e, 4, 0, 0, 16));
    // Foreign contexts are refused.
    let other = common::small();
    let c = other.create_context("c", KvPolicy::Keep).unwrap();
    assert_eq!(
        e.switch_context(None, Some(&c)).unwrap_err().status(),
        Status::BadHandle
    );
    assert!(e.create_sequence_with(0, 0, Some(&c)).is_err());
}

#[test]
fn offload_items_of_wrong_sizes_and_slots_are_refused_without_leaks() {
    const L: u32 = 2;
    const H: u32 = 2;
    const D: u32 = 4;
    const BT: u32 = 4;
    const SLOTS: u32 = 3;
    let e = common::engine(L, H, D, BT, 16, 16);
    let slot_elems = (BT * H * D) as usize;
    let mut k: Vec<Vec<f32>> = (0..L)
        .map(|l| {
            (0..slot_elems * SLOTS as usize)
                .map(|i| (l * 1000) as f32 + i as f32)
                .collect()
        })
        .collect();
    let mut v: Vec<Vec<f32>> = k.iter().map(|x| x.iter().map(|y| -y).collect()).collect();
    let orig = (k.clone(), v.clone());
    let kp: Vec<*mut c_void> = k.iter_mut().map(|x| x.as_mut_ptr().cast()).collect();
    let vp: Vec<*mut c_void> = v.iter_mut().map(|x| x.as_mut_ptr().cast()).collect();
    let row = u64::from(D) * 4;
    // Base pointer arrays of the wrong length are refused.
    // SAFETY: nothing is registered.
    assert!(unsafe { Pool::register(&e, &kp[..1], &vp, SLOTS, 0, 0, 0) }.is_err());
    // SAFETY: the vectors outlive the pool; this thread only reads them
    // after the batches' fences (the batches are waited before).
    let pool = unsafe {
        Pool::register(
            &e,
            &kp,
            &vp,
            SLOTS,
            slot_elems as u64 * 4,
            u64::from(H) * row,
            row,
        )
    }
    .unwrap();
    let toks = [[1, 2, 3, 4], [5, 6, 7, 8]];
    let before = e.stats().unwrap().blocks_allocated;
    for bad in [
        vec![OffloadItem {
            slot: 0,
            scope: 0,
            parent_hash: 0,
            tokens: &toks[0][..3],
        }],
        vec![OffloadItem {
            slot: 0,
            scope: 0,
            parent_hash: 0,
            tokens: &[],
        }],
        vec![OffloadItem {
            slot: SLOTS,
            scope: 0,
            parent_hash: 0,
            tokens: &toks[0],
        }],
        vec![OffloadItem {
            slot: u32::MAX,
            scope: 0,
            parent_hash: 0,
            tokens: &toks[0],
        }],
        vec![
            OffloadItem {
                slot: 1,
                scope: 0,
                parent_hash: 0,
                tokens: &toks[0],
            },
            OffloadItem {
                slot: 1,
                scope: 0,
                parent_hash: 0,
                tokens: &toks[1],
            },
        ],
    ] {
        let err = pool.offload_batch(&bad, 0).unwrap_err();
        assert!(
            matches!(err.status(), Status::InvalidArg | Status::Range),
            "{err}"
        );
    }
    assert_eq!(
        e.stats().unwrap().blocks_allocated,
        before,
        "a refused batch allocated"
    );
    let batch = pool
        .offload_batch(
            &[OffloadItem {
                slot: 2,
                scope: 0,
                parent_hash: 0,
                tokens: &toks[1],
            }],
            0,
        )
        .unwrap();
    batch.wait(None).unwrap();
    assert_eq!(batch.statuses().unwrap(), vec![Status::Ok]);
    let blocks = batch.into_blocks();
    let blk = blocks[0].block();
    assert_eq!(blocks[0].info().unwrap().refs, 1);
    // Restores with bad layers, slots or duplicate slots.
    for (items, first, n) in [
        (vec![(blk, 0u32)], 0u32, 0u32),
        (vec![(blk, 0)], L, 1),
        (vec![(blk, 0)], 1, L),
        (vec![(blk, SLOTS)], 0, L),
        (vec![(blk, 0), (blk, 0)], 0, L),
    ] {
        assert!(
            pool.restore_batch(&items, first, n).is_err(),
            "{items:?} {first}+{n} accepted"
        );
    }
    // A good restore into slot 0 copies slot 2's bytes there.
    let r = pool.restore_batch(&[(blk, 0)], 0, L).unwrap();
    r.wait_layer(L - 1, None).unwrap();
    assert_eq!(r.wait_layer(L, None).unwrap_err().status(), Status::Range);
    r.wait(None).unwrap();
    assert_eq!(r.statuses().unwrap(), vec![Status::Ok]);
    drop(r);
    drop(blocks);
    drop(pool);
    for l in 0..L as usize {
        assert_eq!(
            k[l][..slot_elems],
            orig.0[l][2 * slot_elems..],
            "K layer {l}"
        );
        assert_eq!(
            v[l][..slot_elems],
            orig.1[l][2 * slot_elems..],
            "V layer {l}"
        );
        assert_eq!(k[l][slot_elems..], orig.0[l][slot_elems..], "K layer {l}");
    }
    if let Ok(info) = e.block_info(blk) {
        assert_eq!(info.refs, 0, "the offloaded block leaked a reference");
    }
}

#[test]
fn degenerate_geometry_is_refused_or_consistent() {
    // Zero or out-of-range geometry must be refused at open; where the
    // library takes a value, the geometry the crate checks slices against
    // must be the one in use (no division by zero in a later call).
    let configs = [
        Config::new().block_tokens(0),
        Config::new().block_tokens(3),
        Config::new().block_tokens(512),
        Config::new().head_dim(0),
        Config::new().num_layers(0),
        Config::new().num_kv_heads(0),
        Config::new().num_kv_heads(u32::MAX).head_dim(u32::MAX),
    ];
    for (i, c) in configs.into_iter().enumerate() {
        let c = c.backend(Backend::Cpu).device_bytes(1 << 20).host_bytes(0);
        let Ok(e) = Engine::open(c) else {
            continue;
        };
        let g = *e.geometry();
        assert!(
            g.block_tokens > 0 && g.head_dim > 0 && g.num_layers > 0 && g.num_kv_heads > 0,
            "config {i} opened with geometry {g:?}"
        );
        assert_eq!(
            e.block_bytes(),
            2 * u64::from(g.num_layers)
                * u64::from(g.num_kv_heads)
                * u64::from(g.head_dim)
                * u64::from(g.block_tokens)
                * g.dtype.size() as u64,
            "config {i}: block_bytes disagrees with the geometry"
        );
        let s = e.create_sequence(0).unwrap();
        s.append(&[1; 5]).unwrap();
        let _ = e.block_table(&[&s]);
        let _ = e.prefix_lookup(&[1; 64]);
    }
}

// A view's slice stays as it was while borrowed, even with its sequence on
// another thread rewriting the tokens just past what the view maps: a
// refresh cannot land between a write's check of the mapped tokens and
// the write itself.
#[test]
fn a_view_slice_never_changes_while_its_sequence_writes_on_another_thread() {
    let hd = 64u32;
    let engine = Engine::open(
        common::one_head_view_config()
            .device_bytes(16 << 20)
            .host_bytes(0),
    )
    .unwrap();
    let seq = engine.create_sequence(0).unwrap();
    seq.append(&[1; 16]).unwrap();
    let zero = vec![0f32; 16 * hd as usize];
    seq.write_kv(0, 0, &zero, &zero).unwrap();
    let mut view = seq.vmap(0, 16 * 400).unwrap();
    let stop = AtomicBool::new(false);
    let mut changed = 0u32;
    std::thread::scope(|s| {
        let stop = &stop;
        s.spawn(move || {
            let mut val = 1.0f32;
            for _ in 1..300 {
                let pos = seq.len().unwrap();
                seq.append(&[2; 16]).unwrap();
                loop {
                    val += 1.0;
                    let k = vec![val; 16 * hd as usize];
                    match seq.write_kv(0, pos, &k, &k) {
                        Ok(()) => {}
                        Err(e) if e.status() == Status::Busy && e.message().contains("a view") => {
                            break
                        }
                        Err(e) => assert_eq!(e.status(), Status::Busy, "{e}"),
                    }
                }
            }
            stop.store(true, Ordering::Relaxed);
        });
        while !stop.load(Ordering::Relaxed) {
            if view.refresh().is_err() {
                continue;
            }
            let k: &[f32] = view.k::<f32>(0).unwrap();
            let before = k.to_vec();
            for _ in 0..200 {
                std::hint::spin_loop();
            }
            if before != k {
                changed += 1;
            }
        }
    });
    assert_eq!(changed, 0, "slices changed while borrowed");
}

#[test]
fn small_edges_of_holds_and_histograms() {
    assert_eq!(kvh::LatencyHistogram::bound_ns(usize::MAX), None);
    assert_eq!(
        kvh::LatencyHistogram::bound_ns(kvh::LATENCY_BUCKETS - 1),
        None
    );
    assert!(kvh::LatencyHistogram::bound_ns(0).is_some());
    let e = common::small();
    let s = e.create_sequence(0).unwrap();
    s.append(&[1; 8]).unwrap();
    let h = s.acquire(8..8).unwrap(); // covers no token
    s.truncate(4).unwrap();
    drop(h);
}

/// A batch whose tables would pass i32::MAX blocks is Err(Range) at once,
/// never doubled allocations until one fails (kvh_block_table refuses it
/// whatever the room).
#[test]
fn a_block_table_past_i32_max_blocks_is_range_without_allocating() {
    let blocks: u64 = 1 << 16;
    let e = Engine::open(
        Config::new()
            .backend(Backend::Cpu)
            .dtype(DType::F16)
            .num_layers(1)
            .num_kv_heads(1)
            .head_dim(1)
            .block_tokens(1)
            .device_bytes(blocks * 64)
            .host_bytes(0),
    )
    .unwrap();
    let s = e.create_sequence(0).unwrap();
    s.append(&vec![7i32; blocks as usize]).unwrap();
    let repeats = (i32::MAX as u64 / blocks + 1) as usize;
    let batch: Vec<&kvh::Sequence<'_>> = vec![&s; repeats];
    let t = std::time::Instant::now();
    let err = e
        .block_table(&batch)
        .expect_err("a table past i32::MAX blocks");
    assert_eq!(err.status(), Status::Range, "{err}");
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(e.block_table(&[&s]).unwrap().indices.len(), blocks as usize);
}

/// More transfers than the pool has slots: refused before the tokens of
/// every item are copied (InvalidArg, as kvh.h says for n > num_slots).
#[test]
fn pool_batches_with_more_items_than_slots_are_refused_first() {
    const BT: u32 = 4;
    let e = common::engine(1, 1, 4, BT, 16, 16);
    let mut k = vec![0f32; (BT * 4) as usize];
    let mut v = vec![0f32; (BT * 4) as usize];
    let kp = [k.as_mut_ptr().cast::<c_void>()];
    let vp = [v.as_mut_ptr().cast::<c_void>()];
    // SAFETY: the vectors outlive the pool and nothing else touches them.
    let pool = unsafe { Pool::register(&e, &kp, &vp, 1, u64::from(BT) * 16, 16, 16) }.unwrap();
    let tokens = [1i32, 2, 3, 4];
    let items: Vec<OffloadItem<'_>> = (0..3)
        .map(|_| OffloadItem {
            slot: 0,
            scope: 0,
            parent_hash: 0,
            tokens: &tokens,
        })
        .collect();
    let err = pool
        .offload_batch(&items, 0)
        .expect_err("3 items for 1 slot");
    assert_eq!(err.status(), Status::InvalidArg, "{err}");
    let err = pool.restore_batch(&[], 0, 1).map(|_| ()).err();
    assert!(err.is_none(), "an empty restore is fine: {err:?}");
}
