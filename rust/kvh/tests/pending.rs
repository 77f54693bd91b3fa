//! Calls whose implementation is landing while this crate is written:
//! `persist` (the disk tier) and paged attention. Each test accepts
//! `Err(Unsupported)` or a correct result, so it keeps passing when they land.

mod common;

use kvh::{AttentionParams, Backend, Config, DType, Engine, Sequence, Status};

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvh-rust-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn persist_without_a_disk_tier_is_unsupported() {
    let e = common::engine(1, 1, 4, 4, 8, 8);
    let s = e.create_sequence(0).unwrap();
    s.append(&[1; 8]).unwrap();
    common::fill(&e, &s, 1);
    let err = s.persist().unwrap_err();
    assert_eq!(err.status(), Status::Unsupported, "{err}");
}

#[test]
fn persist_with_a_disk_tier_is_durable_or_unsupported() {
    let dir = temp_dir("persist");
    let config = || {
        Config::new()
            .backend(Backend::Cpu)
            .dtype(DType::F32)
            .num_kv_heads(2)
            .head_dim(8)
            .block_tokens(4)
            .model_salt(0x5eed)
            .device_bytes(1 << 20)
            .host_bytes(1 << 20)
            .disk(&dir, 16 << 20)
    };
    let prompt: Vec<i32> = (0..12).collect();
    let persisted = match Engine::open(config()) {
        Err(err) => {
            assert_eq!(err.status(), Status::Unsupported, "{err}");
            false
        }
        Ok(e) => {
            assert!(e.tier_info(kvh::Tier::Disk).unwrap().present());
            let s = e.create_sequence(0).unwrap();
            s.append(&prompt).unwrap();
            common::fill(&e, &s, 3);
            match s.persist() {
                Ok(()) => true,
                Err(err) => {
                    assert_eq!(err.status(), Status::Unsupported, "{err}");
                    false
                }
            }
        }
    };
    eprintln!(
        "persist: {}",
        if persisted {
            "durable"
        } else {
            "unsupported by this build"
        }
    );
    if persisted {
        // A later engine on the same directory finds the blocks.
        let e = Engine::open(config()).unwrap();
        let s = e.create_sequence(0).unwrap();
        assert_eq!(s.match_prefix(&prompt).unwrap(), 12);
        let (k, v) = common::kv(&e, 3, 0, 0, 12);
        assert_eq!(s.read_kv_vec::<f32>(0, 0, 12).unwrap(), (k, v));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Softmax attention of one query head over tokens [0, upto] of K/V.
#[allow(clippy::too_many_arguments)]
fn reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    kv_heads: usize,
    g: usize,
    dim: usize,
    upto: usize,
    scale: f32,
) -> Vec<f32> {
    let scores: Vec<f32> = (0..=upto)
        .map(|t| {
            let kt = &k[(t * kv_heads + g) * dim..][..dim];
            scale * q.iter().zip(kt).map(|(a, b)| a * b).sum::<f32>()
        })
        .collect();
    let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let w: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f32 = w.iter().sum();
    let mut out = vec![0f32; dim];
    for (t, wt) in w.iter().enumerate() {
        let vt = &v[(t * kv_heads + g) * dim..][..dim];
        for (o, x) in out.iter_mut().zip(vt) {
            *o += wt / sum * x;
        }
    }
    out
}

fn close(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= 1e-4 * (1.0 + y.abs()))
}

struct Batch<'e> {
    seqs: Vec<Sequence<'e>>,
}

fn batch<'e>(e: &'e Engine, lens: &[usize]) -> Batch<'e> {
    let g = *e.geometry();
    let per = g.token_elems();
    let seqs = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let s = e.create_sequence(i as u32).unwrap();
            s.append(&vec![i as i32; n]).unwrap();
            for layer in 0..g.num_layers {
                // Small values keep the softmax well conditioned.
                let k: Vec<f32> = (0..n * per)
                    .map(|j| ((j * 7 + i) % 13) as f32 / 13.0 - 0.5)
                    .collect();
                let v: Vec<f32> = (0..n * per)
                    .map(|j| ((j * 5 + i) % 11) as f32 / 11.0)
                    .collect();
                s.write_kv(layer, 0, &k, &v).unwrap();
            }
            s
        })
        .collect();
    Batch { seqs }
}

fn attention_engine() -> Engine {
    attention_engine_with(1 << 20)
}

fn attention_engine_with(device_bytes: u64) -> Engine {
    Engine::open(
        Config::new()
            .backend(Backend::Cpu)
            .dtype(DType::F32)
            .num_layers(2)
            .num_kv_heads(2)
            .head_dim(8)
            .block_tokens(4)
            .device_bytes(device_bytes)
            .host_bytes(1 << 20),
    )
    .unwrap()
}

#[test]
fn attention_decode_matches_a_reference_or_is_unsupported() {
    let e = attention_engine();
    let g = *e.geometry();
    let (kvh_, dim) = (g.num_kv_heads as usize, g.head_dim as usize);
    let b = batch(&e, &[5, 9, 1]);
    let _holds: Vec<_> = b.seqs.iter().map(|s| s.acquire(..).unwrap()).collect();
    let refs: Vec<&Sequence<'_>> = b.seqs.iter().collect();

    for (q_heads, params) in [
        (kvh_, None),
        (
            2 * kvh_,
            Some(AttentionParams {
                num_q_heads: 2 * g.num_kv_heads,
                ..Default::default()
            }),
        ),
    ] {
        let n = refs.len() * q_heads * dim;
        let q: Vec<f32> = (0..n).map(|i| ((i * 3) % 17) as f32 / 17.0 - 0.5).collect();
        let mut out = vec![0f32; n];
        // Lengths are checked first, whether or not the kernels exist.
        let err = e
            .attention_decode(1, &refs, &q[1..], &mut out[1..], params.as_ref())
            .unwrap_err();
        assert_eq!(err.status(), Status::InvalidArg, "{err}");
        let err = e
            .attention_decode::<u16>(1, &refs, &vec![0; n], &mut vec![0; n], params.as_ref())
            .unwrap_err();
        assert_eq!(err.status(), Status::InvalidArg, "{err}");

        match e.attention_decode(1, &refs, &q, &mut out, params.as_ref()) {
            Err(err) => assert_eq!(err.status(), Status::Unsupported, "{err}"),
            Ok(()) => {
                let scale = 1.0 / (dim as f32).sqrt();
                for (i, s) in b.seqs.iter().enumerate() {
                    let len = s.len().unwrap() as usize;
                    let (k, v) = s.read_kv_vec::<f32>(1, 0, len).unwrap();
                    for h in 0..q_heads {
                        let grp = h / (q_heads / kvh_);
                        let qh = &q[(i * q_heads + h) * dim..][..dim];
                        let want = reference(qh, &k, &v, kvh_, grp, dim, len - 1, scale);
                        let got = &out[(i * q_heads + h) * dim..][..dim];
                        assert!(close(got, &want), "seq {i} head {h}: {got:?} vs {want:?}");
                    }
                }
            }
        }
    }
}

#[test]
fn attention_prefill_matches_a_reference_or_is_unsupported() {
    let e = attention_engine();
    let g = *e.geometry();
    let (kvh_, dim) = (g.num_kv_heads as usize, g.head_dim as usize);
    let b = batch(&e, &[6, 3]);
    let _holds: Vec<_> = b.seqs.iter().map(|s| s.acquire(..).unwrap()).collect();
    let refs: Vec<&Sequence<'_>> = b.seqs.iter().collect();
    let q_lens = [4u32, 3];
    let n = 7 * kvh_ * dim;
    let q: Vec<f32> = (0..n).map(|i| ((i * 5) % 19) as f32 / 19.0 - 0.5).collect();
    let mut out = vec![0f32; n];
    let err = e
        .attention_prefill(0, &refs, &q_lens[..1], &q, &mut out, None)
        .unwrap_err();
    assert_eq!(err.status(), Status::InvalidArg);
    let err = e
        .attention_prefill(0, &refs, &q_lens, &q[..n - 1], &mut out[..n - 1], None)
        .unwrap_err();
    assert_eq!(err.status(), Status::InvalidArg);
    match e.attention_prefill(0, &refs, &q_lens, &q, &mut out, None) {
        Err(err) => assert_eq!(err.status(), Status::Unsupported, "{err}"),
        Ok(()) => {
            let scale = 1.0 / (dim as f32).sqrt();
            let mut row = 0;
            for (i, s) in b.seqs.iter().enumerate() {
                let len = s.len().unwrap() as usize;
                let (k, v) = s.read_kv_vec::<f32>(0, 0, len).unwrap();
                for j in 0..q_lens[i] as usize {
                    let pos = len - q_lens[i] as usize + j;
                    for h in 0..kvh_ {
                        let qh = &q[(row * kvh_ + h) * dim..][..dim];
                        let want = reference(qh, &k, &v, kvh_, h, dim, pos, scale);
                        let got = &out[(row * kvh_ + h) * dim..][..dim];
                        assert!(close(got, &want), "seq {i} query {j} head {h}");
                    }
                    row += 1;
                }
            }
        }
    }
}

#[test]
fn streamed_decode_attends_a_sequence_outside_the_device_tier() {
    // A device tier of 4 blocks of 4 tokens; 40 tokens, all moved to host.
    let e = attention_engine_with(4 * 2 * 2 * 4 * 2 * 8 * 4);
    let g = *e.geometry();
    let b = batch(&e, &[40]);
    b.seqs[0]
        .migrate(.., kvh::Tier::Host)
        .unwrap()
        .wait(None)
        .unwrap();
    let refs: Vec<&Sequence<'_>> = b.seqs.iter().collect();
    let dim = g.head_dim as usize;
    let n = g.num_kv_heads as usize * dim;
    let q: Vec<f32> = (0..n).map(|i| (i % 5) as f32 / 5.0 - 0.4).collect();
    let mut out = vec![0f32; n];
    let bad = AttentionParams {
        stream_chunk_blocks: 2,
        stream_window_blocks: 1,
        ..Default::default()
    };
    let err = e
        .attention_decode(1, &refs, &q, &mut out, Some(&bad))
        .unwrap_err();
    assert_eq!(err.status(), Status::InvalidArg, "{err}");
    let p = AttentionParams {
        stream_chunk_blocks: 2,
        stream_window_blocks: 2,
        ..Default::default()
    };
    e.attention_decode(1, &refs, &q, &mut out, Some(&p))
        .unwrap();
    // The reference: softmax(q.k / sqrt(dim)) . v per head.
    let (k, v) = b.seqs[0].read_kv_vec::<f32>(1, 0, 40).unwrap();
    for h in 0..g.num_kv_heads as usize {
        let qh = &q[h * dim..(h + 1) * dim];
        let scores: Vec<f32> = (0..40)
            .map(|t| {
                let kt = &k[(t * g.num_kv_heads as usize + h) * dim..][..dim];
                qh.iter().zip(kt).map(|(a, b)| a * b).sum::<f32>() / (dim as f32).sqrt()
            })
            .collect();
        let mx = scores.iter().cloned().fold(f32::MIN, f32::max);
        let w: Vec<f32> = scores.iter().map(|s| (s - mx).exp()).collect();
        let sum: f32 = w.iter().sum();
        for d in 0..dim {
            let want: f32 = (0..40)
                .map(|t| w[t] * v[(t * g.num_kv_heads as usize + h) * dim + d])
                .sum::<f32>()
                / sum;
            assert!((out[h * dim + d] - want).abs() < 1e-4, "head {h} dim {d}");
        }
    }
}
