//! KV codecs through the safe wrapper: round trips within the documented
//! bound, and an engine whose host tier holds quantised blocks.
use kvh::codec::{decode, encode, vector_bytes};
use kvh::{Codec, Config, DType, Tier};

#[test]
fn int8_round_trip_within_bound() {
    let x: Vec<f32> = (0..256)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
        .collect();
    let enc = encode(Codec::Int8, DType::F32, 64, &x).unwrap();
    assert_eq!(
        enc.len(),
        4 * vector_bytes(Codec::Int8, DType::F32, 64).unwrap()
    );
    let mut y = vec![0f32; 256];
    decode(Codec::Int8, DType::F32, 64, &enc, &mut y).unwrap();
    for v in 0..4 {
        let xs = &x[v * 64..(v + 1) * 64];
        let amax = xs.iter().fold(0f32, |m, a| m.max(a.abs()));
        for i in 0..64 {
            assert!((xs[i] - y[v * 64 + i]).abs() <= amax / 254.0 * 1.0001);
        }
    }
    assert!(vector_bytes(Codec::Q4G64, DType::F16, 80).is_err());
}

#[test]
fn host_tier_shrinks_under_a_codec() {
    let raw_block = 2 * 2 * 64 * 16 * 4u64;
    let cfg = Config::new()
        .num_layers(2)
        .head_dim(64)
        .dtype(DType::F32)
        .backend(kvh::Backend::Cpu)
        .device_bytes(4 * raw_block)
        .host_bytes(4 * raw_block)
        .kv_codec(Codec::Q4G32);
    let engine = kvh::Engine::open(cfg).unwrap();
    let host = engine.tier_info(Tier::Host).unwrap();
    assert!(host.block_bytes < raw_block);
    assert!(host.capacity_blocks >= 4 * 4);
}

#[test]
fn tolerance_is_set_per_range() {
    let cfg = Config::new()
        .head_dim(64)
        .dtype(DType::F32)
        .backend(kvh::Backend::Cpu)
        .device_bytes(1 << 20)
        .host_bytes(1 << 20)
        .eviction(kvh::Eviction::Lctru, 0);
    let engine = kvh::Engine::open(cfg).unwrap();
    let seq = engine.create_sequence(0).unwrap();
    seq.append(&[1; 20]).unwrap();
    seq.set_tolerance(16.., 200).unwrap();
    let blocks = seq.blocks().unwrap();
    assert_eq!(engine.block_info(blocks[0]).unwrap().tolerance, 128);
    assert_eq!(engine.block_info(blocks[1]).unwrap().tolerance, 200);
    assert!(seq.set_tolerance(.., 256).is_err());
    // One block by its handle, as Python's Block.set_tolerance.
    engine.set_block_tolerance(blocks[0], 7).unwrap();
    assert_eq!(engine.block_info(blocks[0]).unwrap().tolerance, 7);
    assert_eq!(
        engine
            .set_block_tolerance(blocks[0], 256)
            .unwrap_err()
            .status(),
        kvh::Status::InvalidArg
    );
    let stale = kvh::Block::from_raw(kvh::sys::kvh_block { id: 0 });
    assert_eq!(
        engine.set_block_tolerance(stale, 1).unwrap_err().status(),
        kvh::Status::BadHandle
    );
}

#[test]
fn attention_plan_runs_like_the_one_shot_call() {
    let cfg = Config::new()
        .num_kv_heads(2)
        .head_dim(64)
        .dtype(DType::F32)
        .backend(kvh::Backend::Cpu)
        .device_bytes(1 << 22)
        .host_bytes(0);
    let engine = kvh::Engine::open(cfg).unwrap();
    let seq = engine.create_sequence(0).unwrap();
    seq.append(&[3; 40]).unwrap();
    let kv: Vec<f32> = (0..40 * 2 * 64)
        .map(|i| ((i * 7919 % 1000) as f32) / 500.0 - 1.0)
        .collect();
    seq.write_kv(0, 0, &kv, &kv).unwrap();
    let q: Vec<f32> = (0..2 * 64).map(|i| (i as f32) / 64.0 - 1.0).collect();
    let (mut a, mut b) = (vec![0f32; 128], vec![1f32; 128]);
    engine
        .attention_decode(0, &[&seq], &q, &mut a, None)
        .unwrap();
    let plan = engine
        .attention_plan::<f32>(0, &[&seq], None, None)
        .unwrap();
    plan.run(&q, &mut b).unwrap();
    assert_eq!(a, b);
    assert!(plan.run(&q[1..], &mut b).is_err());
}

#[test]
fn views_are_contiguous_and_attend_like_paged() {
    let cfg = Config::new()
        .num_kv_heads(2)
        .head_dim(64)
        .dtype(DType::F32)
        .backend(kvh::Backend::Cpu)
        .device_bytes(1 << 22)
        .host_bytes(0)
        .vmap(true);
    let engine = kvh::Engine::open(cfg).unwrap();
    let seq = engine.create_sequence(0).unwrap();
    seq.append(&[5; 40]).unwrap();
    let kv: Vec<f32> = (0..40 * 2 * 64)
        .map(|i| ((i * 31 % 997) as f32) / 300.0 - 1.5)
        .collect();
    seq.write_kv(0, 0, &kv, &kv).unwrap();
    let mut view = seq.vmap(0, 0).unwrap();
    assert_eq!(view.info().unwrap().n_tokens, 40);
    let k1: &[f32] = view.k(1).unwrap();
    for t in 0..40 {
        assert_eq!(
            &k1[t * 64..(t + 1) * 64],
            &kv[(t * 2 + 1) * 64..(t * 2 + 2) * 64]
        );
    }
    let q: Vec<f32> = (0..128).map(|i| (i as f32) / 100.0 - 0.6).collect();
    let (mut a, mut b) = (vec![0f32; 128], vec![1f32; 128]);
    engine
        .attention_decode(0, &[&seq], &q, &mut a, None)
        .unwrap();
    engine
        .attention_decode_vmap(&[&view], &q, &mut b, None)
        .unwrap();
    assert_eq!(a, b);
    seq.append(&[6; 10]).unwrap();
    assert!(engine
        .attention_decode_vmap(&[&view], &q, &mut b, None)
        .is_err());
    assert!(view.refresh().unwrap());
    assert_eq!(view.info().unwrap().n_tokens, 50);
}

#[test]
fn prefill_over_views_equals_paged() {
    let cfg = Config::new()
        .head_dim(64)
        .dtype(DType::F32)
        .backend(kvh::Backend::Cpu)
        .device_bytes(1 << 22)
        .host_bytes(0)
        .vmap(true);
    let engine = kvh::Engine::open(cfg).unwrap();
    let seq = engine.create_sequence(0).unwrap();
    seq.append(&[5; 30]).unwrap();
    let kv: Vec<f32> = (0..30 * 64)
        .map(|i| ((i * 17 % 503) as f32) / 200.0 - 1.0)
        .collect();
    seq.write_kv(0, 0, &kv, &kv).unwrap();
    let view = seq.vmap(0, 0).unwrap();
    let q: Vec<f32> = (0..7 * 64)
        .map(|i| ((i % 61) as f32) / 30.0 - 1.0)
        .collect();
    let (mut a, mut b) = (vec![0f32; 7 * 64], vec![1f32; 7 * 64]);
    engine
        .attention_prefill(0, &[&seq], &[7], &q, &mut a, None)
        .unwrap();
    engine
        .attention_prefill_vmap(&[&view], &[7], &q, &mut b, None)
        .unwrap();
    assert_eq!(a, b);
}
