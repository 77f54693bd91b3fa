//! Threads: prefetch hints from several threads while another reads, and
//! an engine shared by threads that each own sequences.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use kvh::{Status, Tier};

#[test]
fn threads_prefetch_while_another_reads() {
    const BT: u32 = 4;
    const BLOCKS: u64 = 32;
    // Device room for 8 blocks, host for all: reads and hints move blocks.
    let e = common::engine(2, 2, 8, BT, 8, 64);
    let s = e.create_sequence(0).unwrap();
    let n = BLOCKS * u64::from(BT);
    // Append and fill 8 blocks at a time so each batch fits the device
    // tier before it is pushed down to the host tier.
    for chunk in 0..BLOCKS / 8 {
        let first = chunk * 8 * u64::from(BT);
        s.append(&(first as i32..(first + 8 * u64::from(BT)) as i32).collect::<Vec<_>>())
            .unwrap();
        for layer in 0..2 {
            let (k, v) = common::kv(&e, 5, layer, first, 8 * BT as usize);
            s.write_kv(layer, first, &k, &v).unwrap();
        }
        s.migrate(first.., Tier::Host).unwrap().wait(None).unwrap();
    }
    assert_eq!(s.len().unwrap(), n);

    let expect: Vec<_> = (0..2)
        .map(|l| common::kv(&e, 5, l, 0, n as usize))
        .collect();
    let per = e.geometry().token_elems();
    let stop = AtomicBool::new(false);
    let hints = AtomicU64::new(0);
    let shared = s.shared();

    std::thread::scope(|scope| {
        for t in 0..4u64 {
            let (stop, hints) = (&stop, &hints);
            scope.spawn(move || {
                let mut i = t;
                while !stop.load(Ordering::Relaxed) {
                    let first = (i * 7 % BLOCKS) * u64::from(BT);
                    let len = u64::from(BT) * (1 + i % 3);
                    let end = (first + len).min(n);
                    if i % 5 == 0 {
                        // Some hints come with a fence, waited from here.
                        let f = shared
                            .prefetch_with_fence(first..end, (i % 4) as i32)
                            .unwrap();
                        f.wait(Some(Duration::from_secs(30))).unwrap();
                    } else {
                        match shared.prefetch(first..end, (i % 4) as i32) {
                            Ok(()) => {}
                            Err(err) => assert_eq!(err.status(), Status::NoSpace, "{err}"),
                        }
                    }
                    assert_eq!(shared.len().unwrap(), n);
                    hints.fetch_add(1, Ordering::Relaxed);
                    i += 4;
                }
            });
        }

        // This thread owns the sequence and keeps reading it.
        let mut reads = 0u64;
        while hints.load(Ordering::Relaxed) < 400 || reads < 200 {
            let pos = (reads * 13) % (n - 8);
            let layer = (reads % 2) as u32;
            let (k, v) = s.read_kv_vec::<f32>(layer, pos, 8).unwrap();
            let (p, q) = (pos as usize * per, (pos as usize + 8) * per);
            assert_eq!(k, expect[layer as usize].0[p..q], "read {reads}");
            assert_eq!(v, expect[layer as usize].1[p..q], "read {reads}");
            reads += 1;
        }
        stop.store(true, Ordering::Relaxed);
    });

    let st = e.stats().unwrap();
    assert!(st.lookups > 0 && st.hits_host > 0, "{st:?}");
    assert!(
        st.prefetch_issued + st.prefetch_skipped > 0,
        "hints reached the engine: {st:?}"
    );
    // All data intact after the storm.
    for layer in 0..2u32 {
        let got = s.read_kv_vec::<f32>(layer, 0, n as usize).unwrap();
        assert_eq!(got, expect[layer as usize]);
    }
}

#[test]
fn an_engine_shared_by_threads_with_their_own_sequences() {
    let e = common::engine(1, 2, 8, 4, 64, 256);
    // A common prefix, cached before the threads start.
    let prompt: Vec<i32> = (0..16).collect();
    let root = e.create_sequence(0).unwrap();
    root.append(&prompt).unwrap();
    common::fill(&e, &root, 1);

    std::thread::scope(|scope| {
        for t in 1..=8u32 {
            let e = &e;
            let prompt = &prompt;
            scope.spawn(move || {
                for round in 0..20 {
                    let s = e.create_sequence(t).unwrap();
                    assert_eq!(s.match_prefix(prompt).unwrap(), 16);
                    let mine: Vec<i32> = (0..(round % 7 + 1))
                        .map(|i| (t * 1000 + i) as i32)
                        .collect();
                    s.append(&mine).unwrap();
                    let (k, v) = common::kv(e, t, 0, 16, mine.len());
                    s.write_kv(0, 16, &k, &v).unwrap();
                    assert_eq!(s.read_kv_vec::<f32>(0, 16, mine.len()).unwrap(), (k, v));
                    let child = s.fork(t + 100).unwrap();
                    child.truncate(16).unwrap();
                    let _ = e.stats().unwrap();
                    let _ = e.tier_info(Tier::Device).unwrap();
                }
            });
        }
    });
    let (k, v) = common::kv(&e, 1, 0, 0, 16);
    assert_eq!(root.read_kv_vec::<f32>(0, 0, 16).unwrap(), (k, v));
    assert!(e.stats().unwrap().prefix_hit_blocks >= 8 * 20 * 4);
}

#[test]
fn fences_are_waited_from_other_threads() {
    let e = common::engine(1, 1, 8, 4, 16, 16);
    let s = e.create_sequence(0).unwrap();
    s.append(&[1; 32]).unwrap();
    common::fill(&e, &s, 2);
    let fence = s.migrate(.., Tier::Host).unwrap();
    std::thread::scope(|scope| {
        let f = &fence;
        let a = scope.spawn(move || f.wait(None));
        let b = scope.spawn(move || f.wait(Some(Duration::from_secs(30))));
        a.join().unwrap().unwrap();
        b.join().unwrap().unwrap();
    });
    assert!(fence.poll().unwrap());
}
