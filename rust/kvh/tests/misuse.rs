//! What safe code can do wrong, end to end: handles forgotten or dropped
//! in any order, a view outliving its sequence, handles of one engine
//! given to another, out-of-range numbers and a panicking log sink. Each
//! must be an `Err` or work; none may crash, hang or panic.

mod common;

use std::sync::{Arc, Mutex};

use kvh::{Backend, Config, DType, Engine, KvPolicy, LogLevel, Status, Tier};

fn small() -> Engine {
    common::engine(2, 2, 8, 4, 64, 256)
}

#[test]
fn forgotten_handles_then_engine_drop() {
    // mem::forget is safe: the engine's close must still end everything.
    for round in 0..4 {
        let engine = small();
        let seq = engine.create_sequence(1).unwrap();
        seq.append(&[1, 2, 3, 4, 5, 6, 7, 8, 9]).unwrap();
        common::fill(&engine, &seq, 1);
        let hold = seq.acquire(..).unwrap();
        let fence = seq.migrate(0..4, Tier::Host).unwrap();
        let block = engine.alloc_block(0).unwrap();
        let ctx = engine.create_context("c", KvPolicy::Demote).unwrap();
        ctx.add_region_bytes("w", 0, &[7u8; 1000]).unwrap();
        engine.switch_context(None, Some(&ctx)).unwrap();
        let (hold2, fence2) = seq.acquire_async(0..4).unwrap();
        match round {
            0 => {
                std::mem::forget(hold);
                std::mem::forget(fence);
                std::mem::forget(block);
                std::mem::forget(ctx);
                std::mem::forget(hold2);
                std::mem::forget(fence2);
                std::mem::forget(seq);
            }
            1 => {
                drop((hold, hold2));
                std::mem::forget(seq);
                drop((fence, fence2, block, ctx));
            }
            _ => {
                drop((fence2, hold2, ctx, block, fence, hold));
                drop(seq);
            }
        }
        let st = engine.stats().unwrap();
        assert!(st.cow_copies < u64::MAX);
        drop(engine);
    }
}

#[test]
fn a_view_outliving_its_sequence_reads_or_errs() {
    let engine = Engine::open(
        Config::new()
            .backend(Backend::Cpu)
            .dtype(DType::F32)
            .num_layers(1)
            .num_kv_heads(1)
            .head_dim(1024)
            .block_tokens(16)
            .device_bytes(64 << 20)
            .host_bytes(64 << 20)
            .vmap(true),
    )
    .unwrap();
    let seq = engine.create_sequence(0).unwrap();
    seq.append(&[5; 32]).unwrap();
    let kv = vec![1.5f32; 32 * 1024];
    seq.write_kv(0, 0, &kv, &kv).unwrap();
    let mut view = match seq.vmap(0, 0) {
        Ok(v) => v,
        Err(e) if e.status() == Status::Unsupported => return, // no views on this machine
        Err(e) => panic!("vmap: {e}"),
    };
    drop(seq);
    // The view keeps its blocks: reading it is defined (the values, or an
    // error), never freed memory.
    if let Ok(k) = view.k::<f32>(0) {
        assert!(
            k.iter().all(|&x| x == 1.5),
            "a freed sequence's view shows other data"
        );
    }
    let _ = view.refresh();
    // Reuse the memory the sequence had and check the view again.
    let other = engine.create_sequence(0).unwrap();
    other.append(&[6; 32]).unwrap();
    let kv2 = vec![-3.0f32; 32 * 1024];
    other.write_kv(0, 0, &kv2, &kv2).unwrap();
    if let Ok(k) = view.k::<f32>(0) {
        assert!(
            k.iter().all(|&x| x == 1.5),
            "the view shows another sequence's KV"
        );
    }
}

#[test]
fn handles_of_another_engine_or_released_are_errors() {
    let a = small();
    let b = small();
    let seq = a.create_sequence(0).unwrap();
    seq.append(&[1, 2, 3, 4]).unwrap();
    let blk = seq.blocks().unwrap()[0];
    assert!(b.block_info(blk).is_err());
    assert!(b.migrate(&[blk], Tier::Host).is_err());
    assert!(b.block_table(&[&seq]).is_err());
    let owned = a.alloc_block(0).unwrap();
    let stale = owned.block();
    owned.release().unwrap();
    assert!(a.block_info(stale).is_err());
    let ca = a.create_context("a", KvPolicy::Keep).unwrap();
    assert!(b.switch_context(None, Some(&ca)).is_err());
    assert_eq!(
        ca.region_bytes(u32::MAX).unwrap_err().status(),
        Status::Range
    );
    assert!(ca.pin(u32::MAX, true).is_err());
}

#[test]
fn out_of_range_numbers_are_errors() {
    let engine = small();
    let seq = engine.create_sequence(u32::MAX).unwrap();
    seq.append(&[i32::MIN, -1, 0, i32::MAX]).unwrap();
    assert!(seq.acquire(u64::MAX..).is_err());
    assert!(seq.acquire(..=u64::MAX).is_err());
    assert!(seq.prefetch(u64::MAX - 1..u64::MAX, i32::MIN).is_err());
    assert!(seq.truncate(u64::MAX).is_err());
    let (start, end) = (3u64, 2u64); // a range that ends before it starts
    assert!(seq.migrate(start..end, Tier::Disk).is_err());
    assert!(seq.set_tolerance(.., u32::MAX).is_err());
    assert!(seq.derive_tolerance(.., f32::NAN).is_err());
    let mut k = vec![0f32; 8 * 2];
    let mut v = vec![0f32; 8 * 2];
    assert!(seq.read_kv(u32::MAX, 0, &mut k, &mut v).is_err());
    assert!(seq.read_kv(0, u64::MAX, &mut k, &mut v).is_err());
    assert!(seq.write_kv(0, u64::MAX, &k, &v).is_err());
    assert!(seq.write_kv(0, 0, &k[..3], &v[..3]).is_err());
    assert!(seq.write_kv::<u16>(0, 0, &[0; 16], &[0; 16]).is_err());
    engine.set_agent_quota(u32::MAX, u64::MAX).unwrap();
    assert!(engine.hint_advance(u64::MAX).is_ok());
    assert_eq!(engine.hint_advance(1).unwrap_err().status(), Status::Range);
    for bad in [
        Config::new().backend(Backend::Cpu).num_layers(u32::MAX),
        Config::new().backend(Backend::Cpu).head_dim(0),
        Config::new().backend(Backend::Cpu).block_tokens(u32::MAX),
        Config::new()
            .backend(Backend::Cpu)
            .device_bytes(u64::MAX)
            .host_bytes(u64::MAX),
        Config::new()
            .backend(Backend::Cpu)
            .disk("/dev/null/kvh", 1 << 20),
        Config::new().backend(Backend::Cpu).remote("not an address"),
    ] {
        assert!(Engine::open(bad).is_err());
    }
}

#[test]
fn a_panicking_log_sink_does_not_unwind_into_c() {
    let seen = Arc::new(Mutex::new(0u32));
    let count = seen.clone();
    // Auto without a GPU logs the CPU backend's choice at open.
    let engine = Engine::open(
        Config::new()
            .backend(Backend::Auto)
            .dtype(DType::F32)
            .head_dim(8)
            .device_bytes(1 << 20)
            .host_bytes(1 << 20)
            .log(LogLevel::Debug, move |_, _| {
                *count.lock().unwrap() += 1;
                panic!("a log sink that panics");
            }),
    )
    .unwrap();
    let cpu = engine.backend() == "cpu";
    let seq = engine.create_sequence(0).unwrap();
    seq.append(&[1; 64]).unwrap();
    assert!(seq.acquire(0..1000).is_err());
    drop(seq);
    drop(engine);
    assert!(!cpu || *seen.lock().unwrap() > 0);
}

#[test]
fn sequences_cross_threads_while_others_work() {
    let engine = Arc::new(small());
    std::thread::scope(|s| {
        for t in 0..4u32 {
            let engine = &engine;
            s.spawn(move || {
                for i in 0..50 {
                    let seq = engine.create_sequence(t).unwrap();
                    seq.append(&[t as i32, i, 1, 2, 3]).unwrap();
                    // Dropped on another thread (Sequence is Send).
                    std::thread::scope(|inner| {
                        inner.spawn(move || drop(seq));
                    });
                    let _ = engine.stats().unwrap();
                }
            });
        }
    });
}

// A plan borrows its sequences (it cannot outlive them, nor can they move
// to another thread while it lives: the compile_fail example on
// AttentionPlan). Rewrites made on the plan's own thread in between runs
// are seen by the next run, and a dropped plan frees its sequences.
#[test]
fn a_plan_sees_rewrites_between_runs_and_releases_its_sequences() {
    let engine = small();
    let g = *engine.geometry();
    let seq = engine.create_sequence(0).unwrap();
    seq.append(&[1, 2, 3, 4, 5, 6]).unwrap();
    let per = (g.num_kv_heads * g.head_dim) as usize;
    let k = vec![0f32; 6 * per];
    seq.write_kv(0, 0, &k, &vec![1f32; 6 * per]).unwrap();
    let plan = engine
        .attention_plan::<f32>(0, &[&seq], None, None)
        .unwrap();
    let q = vec![0.25f32; per];
    let mut out = vec![0f32; per];
    plan.run(&q, &mut out).unwrap();
    assert!(out.iter().all(|&x| (x - 1.0).abs() < 1e-6), "{out:?}");
    seq.write_kv(0, 0, &k, &vec![2f32; 6 * per]).unwrap();
    plan.run(&q, &mut out).unwrap();
    assert!(
        out.iter()
            .all(|&x| (x - 1.0).abs() < 1e-6 || (x - 2.0).abs() < 1e-6),
        "{out:?}"
    );
    let mut short = vec![0f32; 1];
    assert!(plan.run(&q, &mut short).is_err());
    drop(plan);
    drop(seq);
    assert_eq!(engine.tier_info(Tier::Device).unwrap().used_blocks, 0);
}
