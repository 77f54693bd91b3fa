//! A full disk tier makes room from the clean disk copies of cached
//! blocks that stay in memory, and counts them in
//! `Stats::disk_copies_given_back`.

mod common;

use kvh::{Backend, Config, DType, Engine, Status, Tier};

#[test]
fn full_disk_gives_back_clean_copies() {
    let dir = std::env::temp_dir().join(format!("kvh-rust-{}-disk-full", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // 2 x 2 x 8 x 16 f32 blocks of 4 KiB; a disk slot adds a 4 KiB header:
    // four slots.
    let e = Engine::open(
        Config::new()
            .backend(Backend::Cpu)
            .dtype(DType::F32)
            .num_layers(2)
            .num_kv_heads(2)
            .head_dim(8)
            .block_tokens(16)
            .model_salt(0x5eed)
            .device_bytes(64 * 4096)
            .host_bytes(64 * 4096)
            .disk(&dir, 4 * 8192),
    )
    .unwrap();
    let seq = |first: i32, seed: u32| {
        let s = e.create_sequence(0).unwrap();
        s.append(&(first..first + 32).collect::<Vec<i32>>())
            .unwrap();
        common::fill(&e, &s, seed);
        s
    };
    // r's two blocks on disk, and the clean copies persist wrote of u's,
    // which stay in memory: the disk is full.
    let r = seq(0, 1);
    r.migrate(.., Tier::Disk).unwrap().wait(None).unwrap();
    let u = seq(1000, 2);
    u.persist().unwrap();
    assert_eq!(e.tier_info(Tier::Disk).unwrap().used_blocks, 4);
    let w = seq(2000, 3);
    // u still references its blocks: their copies stay.
    assert_eq!(w.persist().unwrap_err().status(), Status::NoSpace);
    assert_eq!(e.stats().unwrap().disk_copies_given_back, 0);
    drop(u); // cached now: their copies are room for a full disk
    let before = e.stats().unwrap();
    w.persist().unwrap();
    let after = e.stats().unwrap();
    assert_eq!(
        after.disk_copies_given_back - before.disk_copies_given_back,
        2
    );
    assert_eq!(after.drops, before.drops);
    // u's blocks stayed cached, intact.
    let t = e.create_sequence(0).unwrap();
    let tokens: Vec<i32> = (1000..1032).collect();
    assert_eq!(t.match_prefix(&tokens).unwrap(), 32);
    assert_eq!(
        t.read_kv_vec::<f32>(1, 0, 32).unwrap(),
        common::kv(&e, 2, 1, 0, 32)
    );
    drop((t, w, r));
    drop(e);
    let _ = std::fs::remove_dir_all(&dir);
}
