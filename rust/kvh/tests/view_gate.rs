//! The view gate of a sequence: a view refreshed on its own thread never
//! overlaps a call on the sequence's thread (which kvh would refuse with
//! Busy, leaving a dropped Hold held for good), and a log sink that calls
//! the sequence again inside a gated call does not deadlock.
mod common;

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use kvh::{Engine, LogLevel, Sequence, Status, Tier};

const CHILD_VAR: &str = "KVH_VIEW_GATE_CHILD";
const CHILD_CASES: &[(&str, fn())] = &[("sink_reenters_a_viewed_sequence", child_sink_reenters)];

#[test]
fn child_entry() {
    common::run_child_case(CHILD_VAR, CHILD_CASES);
}

/// Views on 16 MiB device and host tiers whose moves copy, with two
/// workers: a view's blocks move while other threads use them.
fn moving_view_engine() -> Engine {
    Engine::open(
        common::one_head_view_config()
            .device_bytes(16 << 20)
            .host_bytes(16 << 20)
            .copy_moves(true)
            .migration_threads(2),
    )
    .unwrap()
}

#[test]
fn refreshes_on_the_views_thread_never_make_sequence_calls_busy() {
    let hd = 64u32;
    let engine = moving_view_engine();
    let seq = engine.create_sequence(0).unwrap();
    seq.append(&[1; 64]).unwrap();
    let z = vec![0f32; 64 * hd as usize];
    seq.write_kv(0, 0, &z, &z).unwrap();
    let mut view = match seq.vmap(0, 1024) {
        Ok(v) => v,
        Err(e) if e.status() == Status::Unsupported => return,
        Err(e) => panic!("{e}"),
    };
    let stop = AtomicBool::new(false);
    let busy = AtomicU64::new(0);
    let seq = std::thread::scope(|s| {
        let (stop, busy) = (&stop, &busy);
        let h = s.spawn(move || {
            let mut k = vec![0f32; 16 * hd as usize];
            let mut v = k.clone();
            for i in 0..20000u32 {
                if i % 4 == 0 && seq.len().unwrap() < 900 && seq.append(&[3; 16]).is_ok() {
                    let l = seq.len().unwrap();
                    let _ = seq.migrate(l - 16.., Tier::Host);
                }
                if i % 64 == 0 && seq.len().unwrap() >= 900 {
                    seq.truncate(64).unwrap();
                }
                match seq.acquire(0..16) {
                    Ok(h) => drop(h),
                    Err(e) if e.status() == Status::Busy => {
                        busy.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => panic!("acquire: {e}"),
                }
                if let Err(e) = seq.read_kv(0, 0, &mut k, &mut v) {
                    assert_eq!(e.status(), Status::Busy, "{e}");
                    busy.fetch_add(1, Ordering::Relaxed);
                }
            }
            stop.store(true, Ordering::Relaxed);
            seq
        });
        while !stop.load(Ordering::Relaxed) {
            // Blocks moved to the host tier cannot be mapped: that is all.
            if let Err(e) = view.refresh() {
                assert_eq!(e.status(), Status::NotResident, "{e}");
            }
        }
        h.join().unwrap()
    });
    drop(view);
    assert_eq!(
        busy.load(Ordering::Relaxed),
        0,
        "calls overlapped a refresh"
    );
    let b0 = seq.blocks().unwrap()[0];
    assert_eq!(
        engine.block_info(b0).unwrap().holds,
        0,
        "a dropped Hold stayed held"
    );
    assert_eq!(engine.tier_info(Tier::Device).unwrap().pinned_blocks, 0);
}

#[test]
fn views_made_on_the_sequences_thread_never_overlap_a_refresh() {
    let hd = 64usize;
    let engine = moving_view_engine();
    let seq = engine.create_sequence(0).unwrap();
    seq.append(&[1; 64]).unwrap();
    let z = vec![0f32; 64 * hd];
    seq.write_kv(0, 0, &z, &z).unwrap();
    let mut view = match seq.vmap(0, 1024) {
        Ok(v) => v,
        Err(e) if e.status() == Status::Unsupported => return,
        Err(e) => panic!("{e}"),
    };
    let busy = AtomicU64::new(0);
    let count_busy = |what: &str, e: kvh::Error| match e.status() {
        Status::Busy => {
            busy.fetch_add(1, Ordering::Relaxed);
        }
        // Blocks moved to the host tier cannot be mapped: that is all.
        Status::NotResident => {}
        _ => panic!("{what}: {e}"),
    };
    let seq = std::thread::scope(|s| {
        let h = s.spawn(|| {
            for _ in 0..2000 {
                if seq.len().unwrap() >= 900 {
                    seq.truncate(64).unwrap();
                }
                // A block in flight: making a view waits for it with the
                // lock dropped, as a refresh does.
                seq.append(&[3; 16]).unwrap();
                let l = seq.len().unwrap();
                let _ = seq.migrate(l - 16.., Tier::Host);
                match seq.vmap(0, 1024) {
                    Ok(v) => drop(v),
                    Err(e) => count_busy("vmap", e),
                }
            }
            seq
        });
        while !h.is_finished() {
            if let Err(e) = view.refresh() {
                count_busy("refresh", e);
            }
        }
        h.join().unwrap()
    });
    drop(view);
    assert_eq!(
        busy.load(Ordering::Relaxed),
        0,
        "making a view overlapped a refresh"
    );
    assert_eq!(engine.tier_info(Tier::Device).unwrap().pinned_blocks, 0);
    drop(seq);
}

#[test]
fn a_sink_calling_a_viewed_sequence_inside_its_call_does_not_hang() {
    let (code, text) = common::run_child(
        CHILD_VAR,
        "sink_reenters_a_viewed_sequence",
        Duration::from_secs(60),
        None,
    );
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("sink called back"), "{text}");
}

thread_local! {
    static SEQ: RefCell<Option<Rc<Sequence<'static>>>> = const { RefCell::new(None) };
}

/// A corrupt block brought up by write_kv makes kvh log a warning, handed
/// to the sink on this thread as the call leaves, while the call holds the
/// sequence's view gate; the sink appends to that sequence.
fn child_sink_reenters() {
    let dir = std::env::temp_dir().join(format!("kvh-view-gate-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let hd = 64usize;
    let engine: &'static Engine = Box::leak(Box::new(
        Engine::open(
            common::one_head_view_config()
                .device_bytes(1 << 20)
                .host_bytes(1 << 20)
                .disk(&dir, 4 << 20)
                .migration_threads(1)
                .log(LogLevel::Warn, |_, _| {
                    if let Some(s) = SEQ.with(|c| c.borrow().clone()) {
                        let r = s.append(&[1]);
                        eprintln!("sink called back: {:?}", r.map_err(|e| e.status()));
                    }
                }),
        )
        .unwrap(),
    ));
    let s = Rc::new(engine.create_sequence(0).unwrap());
    let view = match s.vmap(0, 64) {
        Ok(v) => v,
        Err(e) if e.status() == Status::Unsupported => {
            eprintln!("sink called back: skipped, no views here");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let tokens: Vec<i32> = (0..32).collect();
    s.append(&tokens).unwrap();
    let kv0 = vec![0.25f32; 32 * hd];
    s.write_kv(0, 0, &kv0, &kv0).unwrap();
    s.migrate(.., Tier::Disk).unwrap().wait(None).unwrap();
    for ent in std::fs::read_dir(&dir).unwrap() {
        let p = ent.unwrap().path();
        if p.file_name().unwrap().to_string_lossy().starts_with("slab") {
            let mut b = std::fs::read(&p).unwrap();
            for off in (4096 + 100..b.len()).step_by(512) {
                b[off] ^= 0x08;
            }
            std::fs::write(&p, b).unwrap();
        }
    }
    SEQ.with(|c| *c.borrow_mut() = Some(s.clone()));
    let kv = vec![0.5f32; 16 * hd];
    let r = s.write_kv(0, 16, &kv, &kv);
    SEQ.with(|c| c.borrow_mut().take());
    let err = r.expect_err("the block failed its checksum");
    assert_eq!(err.status(), Status::Corrupt);
    assert!(
        !err.message().is_empty(),
        "the sink's call erased the detail"
    );
    drop(view);
    let _ = std::fs::remove_dir_all(&dir);
}
