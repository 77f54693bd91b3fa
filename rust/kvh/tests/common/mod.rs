//! Shared helpers of the integration tests.
#![allow(dead_code)]

use kvh::{Backend, Config, DType, Engine};

/// A small CPU engine: `layers` x `heads` x `dim`, `bt` tokens per block,
/// f32, with room for `device` blocks in the device tier and `host` in the
/// host tier.
pub fn engine(layers: u32, heads: u32, dim: u32, bt: u32, device: u64, host: u64) -> Engine {
    let block = 2 * u64::from(layers * heads * dim * bt) * 4;
    Engine::open(
        Config::new()
            .backend(Backend::Cpu)
            .dtype(DType::F32)
            .num_layers(layers)
            .num_kv_heads(heads)
            .head_dim(dim)
            .block_tokens(bt)
            .device_bytes(device * block)
            .host_bytes(host * block),
    )
    .expect("open engine")
}

/// Deterministic K (and V = -K - 1) for tokens [pos, pos + n) of `layer`.
pub fn kv(engine: &Engine, seed: u32, layer: u32, pos: u64, n: usize) -> (Vec<f32>, Vec<f32>) {
    let per = engine.geometry().token_elems();
    let k: Vec<f32> = (0..n * per)
        .map(|i| {
            let t = pos as usize + i / per;
            (seed as f32) * 1000.0 + (layer as f32) * 100.0 + t as f32 + (i % per) as f32 / 1000.0
        })
        .collect();
    let v = k.iter().map(|x| -x - 1.0).collect();
    (k, v)
}

/// Writes the deterministic KV of every token of every layer.
pub fn fill(engine: &Engine, seq: &kvh::Sequence<'_>, seed: u32) {
    let n = seq.len().unwrap() as usize;
    for layer in 0..engine.geometry().num_layers {
        let (k, v) = kv(engine, seed, layer, 0, n);
        seq.write_kv(layer, 0, &k, &v).unwrap();
    }
}
