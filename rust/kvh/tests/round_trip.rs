//! Round trips: tokens, K/V in every dtype, tiers, holds, block tables.

mod common;

use std::time::Duration;

use kvh::{Backend, Config, DType, Engine, Status, Tier};

#[test]
fn tokens_round_trip() {
    let e = common::engine(1, 1, 4, 4, 16, 16);
    let s = e.create_sequence(0).unwrap();
    assert!(s.is_empty().unwrap());
    s.append(&[1, 2, 3]).unwrap();
    s.append(&[]).unwrap();
    s.append(&[4, 5, 6, 7, 8, 9]).unwrap();
    assert_eq!(s.len().unwrap(), 9);
    assert_eq!(s.tokens().unwrap(), (1..=9).collect::<Vec<_>>());
    let mut part = [0; 3];
    s.tokens_into(4, &mut part).unwrap();
    assert_eq!(part, [5, 6, 7]);
    let err = s.tokens_into(7, &mut part).unwrap_err();
    assert_eq!(err.status(), Status::Range);
    assert!(!err.message().is_empty());
    assert_eq!(s.blocks().unwrap().len(), 3);
    s.truncate(5).unwrap();
    assert_eq!(s.tokens().unwrap(), vec![1, 2, 3, 4, 5]);
    assert_eq!(s.blocks().unwrap().len(), 2);
    assert_eq!(s.truncate(6).unwrap_err().status(), Status::Range);
}

#[test]
fn kv_round_trip_f32_across_blocks_and_layers() {
    let e = common::engine(3, 2, 8, 4, 32, 32);
    let s = e.create_sequence(0).unwrap();
    s.append(&(0..11).collect::<Vec<_>>()).unwrap();
    common::fill(&e, &s, 7);
    for layer in 0..3 {
        let (k, v) = common::kv(&e, 7, layer, 0, 11);
        let (k2, v2) = s.read_kv_vec::<f32>(layer, 0, 11).unwrap();
        assert_eq!((&k, &v), (&k2, &v2), "layer {layer}");
        // An unaligned window that crosses blocks.
        let per = e.geometry().token_elems();
        let (mut kw, mut vw) = (vec![0f32; 5 * per], vec![0f32; 5 * per]);
        s.read_kv(layer, 3, &mut kw, &mut vw).unwrap();
        assert_eq!(kw, k[3 * per..8 * per]);
        assert_eq!(vw, v[3 * per..8 * per]);
        let mut konly = vec![0f32; 2 * per];
        s.read_k(layer, 9, &mut konly).unwrap();
        assert_eq!(konly, k[9 * per..]);
        let mut vonly = vec![0f32; per];
        s.read_v(layer, 0, &mut vonly).unwrap();
        assert_eq!(vonly, v[..per]);
    }
    // Overwrite one token and read it back.
    let per = e.geometry().token_elems();
    let ones = vec![1.0f32; per];
    s.write_kv(1, 6, &ones, &ones).unwrap();
    let (k, _) = s.read_kv_vec::<f32>(1, 6, 1).unwrap();
    assert_eq!(k, ones);
}

#[test]
fn kv_round_trip_16_bit_dtypes() {
    for dtype in [DType::F16, DType::Bf16] {
        let e = Engine::open(
            Config::new()
                .backend(Backend::Cpu)
                .dtype(dtype)
                .num_kv_heads(2)
                .head_dim(4)
                .block_tokens(8)
                .device_bytes(1 << 20)
                .host_bytes(0),
        )
        .unwrap();
        assert_eq!(e.block_bytes(), 2 * 2 * 8 * 4 * 2);
        let s = e.create_sequence(0).unwrap();
        s.append(&[1; 10]).unwrap();
        let k: Vec<u16> = (0..10 * 8).map(|i| i as u16 * 3 + 1).collect();
        let v: Vec<u16> = k.iter().map(|x| !x).collect();
        s.write_kv(0, 0, &k, &v).unwrap();
        let (k2, v2) = s.read_kv_vec::<u16>(0, 0, 10).unwrap();
        assert_eq!((k, v), (k2, v2), "{dtype:?}");
        // f32 slices cannot carry 16-bit data.
        let err = s.read_kv_vec::<f32>(0, 0, 1).unwrap_err();
        assert_eq!(err.status(), Status::InvalidArg);
    }
}

#[test]
fn lengths_and_dtypes_are_checked_before_ffi() {
    let e = common::engine(1, 2, 4, 4, 8, 0);
    let s = e.create_sequence(0).unwrap();
    s.append(&[1, 2, 3, 4]).unwrap();
    common::fill(&e, &s, 1);
    let before = e.stats().unwrap();
    let cases: Vec<(&str, kvh::Error)> = vec![
        (
            "not a multiple",
            s.write_kv(0, 0, &[0f32; 7], &[0f32; 7]).unwrap_err(),
        ),
        (
            "k/v differ",
            s.write_kv(0, 0, &[0f32; 8], &[0f32; 16]).unwrap_err(),
        ),
        (
            "dtype",
            s.write_kv(0, 0, &[0u16; 8], &[0u16; 8]).unwrap_err(),
        ),
        (
            "read k/v differ",
            s.read_kv(0, 0, &mut [0f32; 8], &mut [0f32; 9]).unwrap_err(),
        ),
        (
            "read not a multiple",
            s.read_k(0, 0, &mut [0f32; 3]).unwrap_err(),
        ),
        ("read dtype", s.read_v(0, 0, &mut [0u16; 8]).unwrap_err()),
    ];
    for (what, err) in cases {
        assert_eq!(err.status(), Status::InvalidArg, "{what}: {err}");
        assert!(!err.message().is_empty(), "{what}");
    }
    // None of them reached the library: no block was looked up.
    assert_eq!(e.stats().unwrap().lookups, before.lookups);
}

#[test]
fn unwritten_kv_and_positions_past_the_end_are_range_errors() {
    let e = common::engine(2, 1, 4, 4, 8, 0);
    let s = e.create_sequence(0).unwrap();
    s.append(&[1, 2, 3, 4, 5]).unwrap();
    let (k, v) = common::kv(&e, 1, 0, 0, 5);
    s.write_kv(0, 0, &k, &v).unwrap();
    // Layer 1 was never written.
    let err = s.read_kv_vec::<f32>(1, 0, 1).unwrap_err();
    assert_eq!(err.status(), Status::Range);
    // Tokens 5.. were never appended.
    let (k1, v1) = common::kv(&e, 1, 0, 5, 1);
    assert_eq!(
        s.write_kv(0, 5, &k1, &v1).unwrap_err().status(),
        Status::Range
    );
    assert_eq!(
        s.read_kv_vec::<f32>(0, 4, 2).unwrap_err().status(),
        Status::Range
    );
}

#[test]
fn tiers_blocks_and_stats() {
    let e = common::engine(1, 1, 8, 4, 4, 16);
    let dev = e.tier_info(Tier::Device).unwrap();
    assert_eq!((dev.capacity_blocks, dev.used_blocks), (4, 0));
    assert_eq!(dev.block_bytes, e.block_bytes());
    assert!(dev.present() && dev.base_addr != 0);
    let disk = e.tier_info(Tier::Disk).unwrap();
    assert!(!disk.present());
    assert_eq!(e.backend(), "cpu");

    let s = e.create_sequence(5).unwrap();
    s.append(&[1; 10]).unwrap();
    assert_eq!(e.tier_info(Tier::Device).unwrap().used_blocks, 3);
    let blocks = s.blocks().unwrap();
    let info = e.block_info(blocks[2]).unwrap();
    assert_eq!(info.tier, Some(Tier::Device));
    assert_eq!((info.tokens, info.refs, info.agent), (2, 1, 5));
    assert!(!info.published);
    let mut two = [kvh::Block::from_raw(Default::default()); 2];
    s.blocks_into(1, &mut two).unwrap();
    assert_eq!(&two[..], &blocks[1..]);

    common::fill(&e, &s, 3);
    let _ = s.read_kv_vec::<f32>(0, 0, 10).unwrap();
    let st = e.stats().unwrap();
    assert!(st.lookups > 0 && st.hits_device > 0, "{st:?}");
    assert!(st.blocks_allocated >= 3);
    assert!(st.device_hit_rate() > 0.0);
    drop(s);
    assert!(e.stats().unwrap().blocks_freed >= 1);
}

#[test]
fn migrate_to_host_and_back_keeps_the_data() {
    let e = common::engine(2, 2, 8, 4, 4, 16);
    let s = e.create_sequence(0).unwrap();
    s.append(&(0..16).collect::<Vec<_>>()).unwrap();
    common::fill(&e, &s, 9);
    s.migrate(.., Tier::Host).unwrap().wait(None).unwrap();
    for b in s.blocks().unwrap() {
        assert_eq!(e.block_info(b).unwrap().tier, Some(Tier::Host));
    }
    assert_eq!(e.tier_info(Tier::Device).unwrap().used_blocks, 0);
    // The CPU backend's tiers are one arena: the moves re-account the
    // blocks in place instead of copying them.
    let st = e.stats().unwrap();
    assert!(
        st.blocks_moved_in_place >= 4 && st.blocks_device_to_host == 0,
        "{st:?}"
    );
    for layer in 0..2 {
        let (k, v) = common::kv(&e, 9, layer, 0, 16);
        assert_eq!(s.read_kv_vec::<f32>(layer, 0, 16).unwrap(), (k, v));
    }
    let hold = s.acquire(..).unwrap();
    assert_eq!(hold.range(), 0..16);
    for b in s.blocks().unwrap() {
        let info = e.block_info(b).unwrap();
        assert_eq!(info.tier, Some(Tier::Device));
        assert_eq!(info.holds, 1);
    }
    hold.release().unwrap();
    for b in s.blocks().unwrap() {
        assert_eq!(e.block_info(b).unwrap().holds, 0);
    }
    let (k, v) = common::kv(&e, 9, 1, 0, 16);
    assert_eq!(s.read_kv_vec::<f32>(1, 0, 16).unwrap(), (k, v));
}

#[test]
fn hinted_block_stays_until_used() {
    // Four device slots; a one-block sequence hinted first, eight newer
    // blocks after it: the hint keeps it in the device tier.
    let e = common::engine(1, 1, 4, 4, 4, 32);
    let kept = e.create_sequence(0).unwrap();
    kept.append(&[1, 2, 3, 4]).unwrap();
    kept.hint(.., 5).unwrap();
    let mut others = Vec::new();
    let mut eight_newer = |base: i32| {
        for i in 0..8 {
            let s = e.create_sequence(0).unwrap();
            let t = base + 10 * i;
            s.append(&[t, t + 1, t + 2, t + 3]).unwrap();
            others.push(s);
        }
    };
    eight_newer(100);
    let b = kept.blocks().unwrap()[0];
    assert_eq!(e.block_info(b).unwrap().tier, Some(Tier::Device));
    // Without the hint the oldest block is the first to go.
    let plain = e.create_sequence(0).unwrap();
    plain.append(&[7, 8, 9, 10]).unwrap();
    eight_newer(1000);
    let pb = plain.blocks().unwrap()[0];
    assert_eq!(e.block_info(pb).unwrap().tier, Some(Tier::Host));
    assert_eq!(kept.hint(0..5, 0).unwrap_err().status(), Status::Range);
    kept.shared().hint(0..4, -3).unwrap();
}

#[test]
fn acquire_async_and_block_table() {
    let e = common::engine(1, 1, 8, 4, 8, 16);
    let a = e.create_sequence(0).unwrap();
    let b = e.create_sequence(1).unwrap();
    a.append(&[1; 9]).unwrap();
    b.append(&[2; 4]).unwrap();
    common::fill(&e, &a, 1);
    common::fill(&e, &b, 2);
    a.migrate(.., Tier::Host).unwrap().wait(None).unwrap();
    assert_eq!(
        e.block_table(&[&a, &b]).unwrap_err().status(),
        Status::NotResident
    );
    {
        let (hold, fence) = a.acquire_async(0..9).unwrap();
        fence.wait(Some(Duration::from_secs(10))).unwrap();
        assert!(fence.poll().unwrap());
        let table = e.block_table(&[&a, &b]).unwrap();
        assert_eq!(table.len(), 2);
        assert_eq!(table.indptr, vec![0, 3, 4]);
        assert_eq!(table.last_page_len, vec![1, 4]);
        let slots_a = table.slots(0);
        for (blk, slot) in a.blocks().unwrap().into_iter().zip(slots_a) {
            let info = e.block_info(blk).unwrap();
            assert_eq!(info.slot as i32, *slot);
            assert_eq!(info.holds, 1);
        }
        drop(hold);
    }
    let empty = e.block_table(&[]).unwrap();
    assert!(empty.is_empty());
    assert_eq!(empty.indptr, vec![0]);
}

#[test]
fn pins_nest_and_are_counted() {
    let e = common::engine(1, 1, 8, 4, 8, 8);
    let s = e.create_sequence(0).unwrap();
    s.append(&[1; 8]).unwrap();
    s.pin(..).unwrap();
    s.pin(0..4).unwrap();
    assert_eq!(e.tier_info(Tier::Device).unwrap().pinned_blocks, 2);
    let b0 = s.blocks().unwrap()[0];
    assert_eq!(e.block_info(b0).unwrap().pins, 2);
    s.unpin(0..4).unwrap();
    s.unpin(..).unwrap();
    assert_eq!(e.tier_info(Tier::Device).unwrap().pinned_blocks, 0);
    assert_eq!(s.unpin(..).unwrap_err().status(), Status::InvalidArg);
}

#[test]
fn owned_blocks_count_references() {
    let e = common::engine(1, 1, 8, 4, 8, 8);
    let b = e.alloc_block(3).unwrap();
    let info = b.info().unwrap();
    assert_eq!((info.refs, info.agent, info.tokens), (1, 3, 0));
    let c = b.try_clone().unwrap();
    assert_eq!(b.info().unwrap().refs, 2);
    drop(c);
    assert_eq!(b.info().unwrap().refs, 1);
    b.set_pinned(true).unwrap();
    assert_eq!(b.info().unwrap().pins, 1);
    b.set_pinned(false).unwrap();
    let handle = b.block();
    b.release().unwrap();
    assert_eq!(
        e.block_info(handle).unwrap_err().status(),
        Status::BadHandle
    );
}

#[test]
fn sequences_move_between_threads() {
    let e = common::engine(1, 1, 8, 4, 8, 8);
    let s = e.create_sequence(0).unwrap();
    s.append(&[1, 2, 3]).unwrap();
    let s = std::thread::scope(|scope| {
        scope
            .spawn(move || {
                s.append(&[4]).unwrap();
                s
            })
            .join()
            .unwrap()
    });
    assert_eq!(s.tokens().unwrap(), vec![1, 2, 3, 4]);
}

#[test]
fn log_sink_receives_text() {
    use std::sync::{Arc, Mutex};
    let got = Arc::new(Mutex::new(Vec::<String>::new()));
    let sink = got.clone();
    let e = Engine::open(
        Config::new()
            .backend(Backend::Auto)
            .head_dim(8)
            .device_bytes(1 << 20)
            .host_bytes(0)
            .log(kvh::LogLevel::Debug, move |_, msg| {
                sink.lock().unwrap().push(msg.to_owned())
            }),
    )
    .unwrap();
    drop(e);
    // Whether the library logs at all here is its business; what arrived is text.
    for m in got.lock().unwrap().iter() {
        assert!(!m.contains('\0'));
    }
}
