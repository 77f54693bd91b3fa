//! A hostile user of the less travelled modules of the safe API: views and
//! attention over them, external pools and their batches, weight contexts,
//! latency histograms, fences, queue hints, migration, prefetch and
//! scopes. Every case compiles without `unsafe` (except registering pool
//! memory, whose contract is kept) and must end in `Ok` or an `Err` of the
//! documented kind: never a crash, a hang, a leak, a shared slice changing
//! under its borrow, or bytes other than those written. K/V values are
//! derived from (seed, layer, token, head, dim) and compared bit for bit.
//! Cases that could hang run in a child process (this binary re-run with
//! `KVH_HOSTILE_MODULES_CHILD` naming the case).

mod common;

use std::collections::HashSet;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use kvh::{
    Backend, Block, Config, DType, Engine, Geometry, KvPolicy, LatencyHistogram, LatencyKind,
    OffloadItem, Pool, Scope, Sequence, Status, Tier, VMap, LATENCY_BUCKETS,
};

const CHILD_VAR: &str = "KVH_HOSTILE_MODULES_CHILD";

/// The cases run in a child process, by name.
const CHILD_CASES: &[(&str, fn())] = &[
    ("wait_layer_unloaded", child_wait_layer_unloaded),
    ("view_capacity_limit", child_view_capacity_limit),
    (
        "region_bytes_during_switch",
        child_region_bytes_during_switch,
    ),
];

/// Entry of the child process: runs the case named by the variable
/// (nothing in a normal run).
#[test]
fn child_entry() {
    common::run_child_case(CHILD_VAR, CHILD_CASES);
}

// ---------------------------------------------------------------- helpers

/// An f32 unique to (seed, layer, token, head, dim): an integer below 2^24
/// scaled by a power of two, so every value is exact and none repeats
/// inside one sequence's layer.
fn val(g: &Geometry, seed: u32, layer: u32, token: u64, head: u32, dim: u32) -> f32 {
    let idx = ((token * u64::from(g.num_kv_heads) + u64::from(head)) * u64::from(g.head_dim)
        + u64::from(dim))
        % (1 << 18);
    let hi = u64::from(seed % 16) * 4 + u64::from(layer % 4);
    ((hi << 18) | idx) as f32 / (1u64 << 20) as f32
}

/// K and V (= -K) of tokens [pos, pos + n) of `layer`, shaped
/// [token][head][dim].
fn kv(g: &Geometry, seed: u32, layer: u32, pos: u64, n: usize) -> (Vec<f32>, Vec<f32>) {
    let mut k = Vec::with_capacity(n * g.token_elems());
    for t in pos..pos + n as u64 {
        for h in 0..g.num_kv_heads {
            for d in 0..g.head_dim {
                k.push(val(g, seed, layer, t, h, d));
            }
        }
    }
    let v = k.iter().map(|x| -x).collect();
    (k, v)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|f| f.to_bits()).collect()
}

/// Writes every layer of tokens [pos, pos + n).
fn write(seq: &Sequence<'_>, seed: u32, pos: u64, n: usize) {
    let g = *seq.engine().geometry();
    for layer in 0..g.num_layers {
        let (k, v) = kv(&g, seed, layer, pos, n);
        seq.write_kv(layer, pos, &k, &v).unwrap();
    }
}

/// Asserts that every layer of tokens [pos, pos + n) reads back bit for bit.
fn check(seq: &Sequence<'_>, seed: u32, pos: u64, n: usize, what: &str) {
    let g = *seq.engine().geometry();
    for layer in 0..g.num_layers {
        let (k, v) = kv(&g, seed, layer, pos, n);
        let (k2, v2) = seq.read_kv_vec::<f32>(layer, pos, n).unwrap();
        assert!(bits(&k) == bits(&k2), "{what}: K of layer {layer} differs");
        assert!(bits(&v) == bits(&v2), "{what}: V of layer {layer} differs");
    }
}

const VL: u32 = 2;
const VH: u32 = 2;
const VD: u32 = 64;
const VBT: u32 = 16;

/// A 2-layer engine whose views work (one head's K of a block is a page).
fn view_engine() -> Engine {
    Engine::open(
        Config::new()
            .backend(Backend::Cpu)
            .dtype(DType::F32)
            .num_layers(VL)
            .num_kv_heads(VH)
            .head_dim(VD)
            .block_tokens(VBT)
            .device_bytes(8 << 20)
            .host_bytes(8 << 20)
            .vmap(true),
    )
    .expect("open view engine")
}

/// A sequence of `n` tokens with every layer written with `seed`.
fn filled(e: &Engine, seed: u32, n: usize) -> Sequence<'_> {
    let s = e.create_sequence(0).unwrap();
    s.append(&vec![seed as i32; n]).unwrap();
    write(&s, seed, 0, n);
    s
}

/// A view, or None where this machine cannot map views at all.
fn view<'e>(s: &Sequence<'e>, layer: u32, cap: u64) -> Option<VMap<'e>> {
    match s.vmap(layer, cap) {
        Ok(v) => Some(v),
        Err(err) if err.status() == Status::Unsupported => None,
        Err(err) => panic!("vmap of layer {layer}: {err}"),
    }
}

/// Asserts that a view's slices of `layer` show tokens [0, n) of `seed`.
fn check_view_slices(k: &[&[f32]], v: &[&[f32]], g: &Geometry, seed: u32, layer: u32, n: u64) {
    let d = g.head_dim as usize;
    for h in 0..g.num_kv_heads {
        let (ks, vs) = (k[h as usize], v[h as usize]);
        assert_eq!(ks.len(), n as usize * d, "head {h} K length");
        assert_eq!(vs.len(), n as usize * d, "head {h} V length");
        for t in 0..n {
            for dim in 0..g.head_dim {
                let want = val(g, seed, layer, t, h, dim);
                let i = t as usize * d + dim as usize;
                let (gk, gv) = (std::hint::black_box(ks[i]), std::hint::black_box(vs[i]));
                assert!(
                    gk.to_bits() == want.to_bits() && gv.to_bits() == (-want).to_bits(),
                    "layer {layer} head {h} token {t} dim {dim}: view shows K {gk} V {gv}, \
                     written {want}"
                );
            }
        }
    }
}

fn heads<'a>(view: &'a VMap<'_>, values: bool) -> Vec<&'a [f32]> {
    (0..VH)
        .map(|h| {
            if values {
                view.v::<f32>(h).unwrap()
            } else {
                view.k::<f32>(h).unwrap()
            }
        })
        .collect()
}

fn q_for(rows: usize, per: usize) -> Vec<f32> {
    (0..rows * per)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
        .collect()
}

/// A fresh directory under the temporary directory, removed on drop
/// (also when a test panics).
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("kvh-hm-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------- children

fn child_wait_layer_unloaded() {
    let e = common::context_engine();
    let a = e.create_context("a", KvPolicy::Keep).unwrap();
    a.add_region_bytes("w", 0, &[1u8; 4096]).unwrap();
    // No switch is loading it: the documented answer is NotResident, at
    // once, not an endless wait.
    let err = a.wait_layer(0, None).unwrap_err();
    assert_eq!(err.status(), Status::NotResident, "{err}");
    let err = a.wait_layer(u32::MAX, None).unwrap_err();
    assert_eq!(err.status(), Status::NotResident, "{err}");
    e.switch_context(None, Some(&a)).unwrap();
    a.wait_layer(u32::MAX, None).unwrap();
    // Switched away again: nothing loads it any more.
    e.switch_context(Some(&a), None).unwrap();
    let err = a.wait_layer(0, None).unwrap_err();
    assert_eq!(err.status(), Status::NotResident, "{err}");
}

fn child_view_capacity_limit() {
    let e = view_engine();
    let s = filled(&e, 1, 16);
    // 2^31 is the largest capacity the header allows: reserved (address
    // space only) or refused for memory, and one more is a Range error.
    match s.vmap(0, 1 << 31) {
        Ok(v) => {
            let i = v.info().unwrap();
            assert_eq!((i.n_tokens, i.capacity_tokens), (16, 1 << 31));
        }
        Err(err) => assert!(
            matches!(err.status(), Status::NoMem | Status::Unsupported),
            "{err}"
        ),
    }
    for cap in [(1u64 << 31) + 1, 1 << 32, u64::MAX] {
        let err = s.vmap(0, cap).unwrap_err();
        assert_eq!(err.status(), Status::Range, "capacity {cap}: {err}");
    }
}

#[test]
fn waiting_for_a_context_no_switch_loads_is_not_resident_not_a_hang() {
    common::child_passes(CHILD_VAR, "wait_layer_unloaded", None);
}

#[test]
fn view_capacities_at_the_limit() {
    common::child_passes(CHILD_VAR, "view_capacity_limit", None);
}

// ------------------------------------------------------------------ views

#[test]
fn view_slices_are_bit_exact_per_layer_and_head() {
    let e = view_engine();
    let g = *e.geometry();
    let s = filled(&e, 1, 40);
    let Some(v0) = view(&s, 0, 64) else {
        return;
    };
    let v1 = view(&s, 1, 64).unwrap();
    for (layer, vw) in [(0, &v0), (1, &v1)] {
        let i = vw.info().unwrap();
        assert_eq!(i.n_tokens, 40);
        assert!(i.capacity_tokens >= 64 && i.capacity_tokens.is_power_of_two());
        assert!(i.map_unit > 0);
        assert!(
            ["hugetlb", "thp", "4k"].contains(&vw.backing().unwrap()),
            "{:?}",
            vw.backing()
        );
        check_view_slices(&heads(vw, false), &heads(vw, true), &g, 1, layer, 40);
    }
    // Only the layer a view maps is locked: layer 0 is rewritten once its
    // view is gone, and layer 1's slices do not move.
    drop(v0);
    let k1 = heads(&v1, false);
    let vv1 = heads(&v1, true);
    let (k, v) = kv(&g, 2, 0, 0, 40);
    s.write_kv(0, 0, &k, &v).unwrap();
    let (k, v) = kv(&g, 2, 1, 0, 1);
    assert_eq!(
        s.write_kv(1, 39, &k, &v).unwrap_err().status(),
        Status::Busy
    );
    // A token appended into the partly filled last block, past the view.
    s.append(&[9]).unwrap();
    let (k, v) = kv(&g, 1, 1, 40, 1);
    s.write_kv(1, 40, &k, &v).unwrap();
    check_view_slices(&k1, &vv1, &g, 1, 1, 40);
    let (k2, _) = s.read_kv_vec::<f32>(0, 0, 40).unwrap();
    assert!(bits(&k2) == bits(&kv(&g, 2, 0, 0, 40).0));
    drop(v1);
}

#[test]
fn view_arguments_out_of_range_are_errors() {
    let e = view_engine();
    let s = filled(&e, 3, 20);
    let Some(vw) = view(&s, 0, 33) else {
        return;
    };
    let i = vw.info().unwrap();
    assert_eq!(i.n_tokens, 20);
    assert!(
        i.capacity_tokens >= 33 && i.capacity_tokens.is_power_of_two(),
        "{i:?}"
    );
    for layer in [VL, u32::MAX] {
        assert_eq!(
            s.vmap(layer, 0).unwrap_err().status(),
            Status::Range,
            "layer {layer}"
        );
    }
    // Fewer tokens of room than the sequence holds.
    assert_eq!(s.vmap(0, 19).unwrap_err().status(), Status::Range);
    assert_eq!(s.vmap(0, 1).unwrap_err().status(), Status::Range);
    // Heads past the model and element types that cannot carry f32 data.
    for h in [VH, u32::MAX] {
        assert_eq!(vw.k::<f32>(h).unwrap_err().status(), Status::InvalidArg);
        assert_eq!(vw.v::<f32>(h).unwrap_err().status(), Status::InvalidArg);
    }
    assert_eq!(vw.k::<u16>(0).unwrap_err().status(), Status::InvalidArg);
    drop(vw);
    // Blocks outside the device tier cannot be mapped: acquire first.
    s.migrate(.., Tier::Host).unwrap().wait(None).unwrap();
    assert_eq!(s.vmap(1, 0).unwrap_err().status(), Status::NotResident);
    drop(s.acquire(..).unwrap());
    let vw = s.vmap(1, 0).unwrap();
    assert_eq!(vw.info().unwrap().n_tokens, 20);
    check_view_slices(
        &heads(&vw, false),
        &heads(&vw, true),
        e.geometry(),
        3,
        1,
        20,
    );
}

#[test]
fn a_stale_view_is_refused_by_attention_until_refreshed() {
    let e = view_engine();
    let g = *e.geometry();
    let per = g.token_elems();
    let s = filled(&e, 4, 16);
    let Some(mut vw) = view(&s, 0, 64) else {
        return;
    };
    let q = q_for(1, per);
    let (mut a, mut b) = (vec![0f32; per], vec![0f32; per]);
    e.attention_decode_vmap(&[&vw], &q, &mut a, None).unwrap();
    e.attention_decode(0, &[&s], &q, &mut b, None).unwrap();
    assert!(
        bits(&a) == bits(&b),
        "decode over a view differs from paged"
    );
    // A token in a new block changes the block table: the view is stale.
    s.append(&[7]).unwrap();
    write(&s, 4, 16, 1);
    let err = e
        .attention_decode_vmap(&[&vw], &q, &mut a, None)
        .unwrap_err();
    assert_eq!(err.status(), Status::BadHandle, "{err}");
    let err = e
        .attention_prefill_vmap(&[&vw], &[1], &q, &mut a, None)
        .unwrap_err();
    assert_eq!(err.status(), Status::BadHandle, "{err}");
    let gen = vw.info().unwrap().generation;
    assert!(vw.refresh().unwrap());
    let i = vw.info().unwrap();
    assert_eq!(i.n_tokens, 17);
    assert_ne!(i.generation, gen);
    // Nothing changed since: no remap, same generation.
    assert!(!vw.refresh().unwrap());
    assert_eq!(vw.info().unwrap().generation, i.generation);
    e.attention_decode_vmap(&[&vw], &q, &mut a, None).unwrap();
    e.attention_decode(0, &[&s], &q, &mut b, None).unwrap();
    assert!(bits(&a) == bits(&b), "decode after refresh differs");
    // The same view twice in a batch: two equal rows.
    let q2 = [q.clone(), q.clone()].concat();
    let mut two = vec![0f32; 2 * per];
    e.attention_decode_vmap(&[&vw, &vw], &q2, &mut two, None)
        .unwrap();
    assert!(bits(&two[..per]) == bits(&b) && bits(&two[per..]) == bits(&b));
    // Prefill of the last 3 tokens equals the paged call.
    let q3 = q_for(3, per);
    let (mut p1, mut p2) = (vec![0f32; 3 * per], vec![0f32; 3 * per]);
    e.attention_prefill_vmap(&[&vw], &[3], &q3, &mut p1, None)
        .unwrap();
    e.attention_prefill(0, &[&s], &[3], &q3, &mut p2, None)
        .unwrap();
    assert!(bits(&p1) == bits(&p2), "prefill over a view differs");
    // More queries than the view has tokens.
    let q18 = q_for(18, per);
    let mut o18 = vec![0f32; 18 * per];
    assert_eq!(
        e.attention_prefill_vmap(&[&vw], &[18], &q18, &mut o18, None)
            .unwrap_err()
            .status(),
        Status::Range
    );
    // Shapes that do not match the batch.
    assert_eq!(
        e.attention_prefill_vmap(&[&vw], &[1, 1], &q2, &mut two, None)
            .unwrap_err()
            .status(),
        Status::InvalidArg
    );
    assert_eq!(
        e.attention_decode_vmap(&[&vw], &q2, &mut a, None)
            .unwrap_err()
            .status(),
        Status::InvalidArg
    );
    let mut short = vec![0f32; per - 1];
    assert_eq!(
        e.attention_decode_vmap(&[&vw], &q, &mut short, None)
            .unwrap_err()
            .status(),
        Status::InvalidArg
    );
    // A view of another engine, alone or with one of this engine.
    let other = view_engine();
    let so = filled(&other, 5, 16);
    let vo = so.vmap(0, 0).unwrap();
    for batch in [vec![&vo], vec![&vw, &vo]] {
        let n = batch.len();
        let mut out = vec![0f32; n * per];
        let err = e
            .attention_decode_vmap(&batch, &q_for(n, per), &mut out, None)
            .unwrap_err();
        assert_eq!(err.status(), Status::BadHandle, "{err}");
    }
    // The refused calls changed nothing.
    e.attention_decode_vmap(&[&vw], &q, &mut a, None).unwrap();
    assert!(bits(&a) == bits(&b));
}

#[test]
fn refreshing_past_the_capacity_is_range_and_the_view_stays_usable() {
    let e = view_engine();
    let g = *e.geometry();
    let s = filled(&e, 5, 16);
    let Some(mut vw) = view(&s, 1, 16) else {
        return;
    };
    assert_eq!(vw.info().unwrap().capacity_tokens, 16);
    s.append(&[5; 16]).unwrap();
    write(&s, 5, 16, 16);
    let err = vw.refresh().unwrap_err();
    assert_eq!(err.status(), Status::Range, "{err}");
    assert_eq!(vw.info().unwrap().n_tokens, 16);
    check_view_slices(&heads(&vw, false), &heads(&vw, true), &g, 5, 1, 16);
    // Still stale: attention refuses it.
    let per = g.token_elems();
    let mut out = vec![0f32; per];
    assert_eq!(
        e.attention_decode_vmap(&[&vw], &q_for(1, per), &mut out, None)
            .unwrap_err()
            .status(),
        Status::BadHandle
    );
    drop(vw);
    let vw = s.vmap(1, 0).unwrap();
    assert_eq!(vw.info().unwrap().n_tokens, 32);
    check_view_slices(&heads(&vw, false), &heads(&vw, true), &g, 5, 1, 32);
}

#[test]
fn a_view_outliving_its_sequence_attends_as_before_until_refreshed() {
    let e = view_engine();
    let g = *e.geometry();
    let per = g.token_elems();
    let s = filled(&e, 16, 40);
    let Some(mut vw) = view(&s, 1, 64) else {
        return;
    };
    let q = q_for(1, per);
    let (mut before, mut after) = (vec![0f32; per], vec![0f32; per]);
    e.attention_decode_vmap(&[&vw], &q, &mut before, None)
        .unwrap();
    let child = s.fork(1).unwrap();
    drop(s);
    // The fork overwrites every token it shares with the view.
    write(&child, 17, 0, 40);
    check(&child, 17, 0, 40, "the fork");
    check_view_slices(&heads(&vw, false), &heads(&vw, true), &g, 16, 1, 40);
    match e.attention_decode_vmap(&[&vw], &q, &mut after, None) {
        Ok(()) => assert!(bits(&before) == bits(&after), "the view attends other KV"),
        Err(err) => assert_eq!(err.status(), Status::BadHandle, "{err}"),
    }
    // Its sequence is gone: a refresh has nothing to follow.
    if let Err(err) = vw.refresh() {
        assert_eq!(err.status(), Status::BadHandle, "{err}");
    }
    drop(vw);
    drop(child);
}

#[test]
fn sixteen_bit_views_are_bit_exact() {
    // f16, head_dim 128, 16 tokens: one head's K of a block is 4 KiB.
    let e = Engine::open(
        Config::new()
            .backend(Backend::Cpu)
            .dtype(DType::F16)
            .num_layers(1)
            .num_kv_heads(2)
            .head_dim(128)
            .block_tokens(16)
            .device_bytes(4 << 20)
            .host_bytes(0)
            .vmap(true),
    )
    .unwrap();
    let per = e.geometry().token_elems();
    let s = e.create_sequence(0).unwrap();
    s.append(&[1; 20]).unwrap();
    // Every bit pattern class: NaN payloads, infinities, subnormals, -0.
    let k: Vec<u16> = (0..20 * per as u32)
        .map(|i| (i.wrapping_mul(40503) ^ (i >> 3)) as u16)
        .collect();
    let v: Vec<u16> = k.iter().map(|x| !x).collect();
    s.write_kv(0, 0, &k, &v).unwrap();
    let Some(vw) = view(&s, 0, 0) else {
        return;
    };
    assert_eq!(vw.k::<f32>(0).unwrap_err().status(), Status::InvalidArg);
    for h in 0..2usize {
        let (ks, vs) = (
            vw.k::<u16>(h as u32).unwrap(),
            vw.v::<u16>(h as u32).unwrap(),
        );
        assert_eq!(ks.len(), 20 * 128);
        for t in 0..20usize {
            let src = t * per + h * 128..t * per + (h + 1) * 128;
            assert_eq!(
                ks[t * 128..(t + 1) * 128],
                k[src.clone()],
                "K head {h} token {t}"
            );
            assert_eq!(vs[t * 128..(t + 1) * 128], v[src], "V head {h} token {t}");
        }
    }
}

#[test]
fn a_view_keeps_its_blocks_in_the_device_tier() {
    let e = view_engine();
    let s = filled(&e, 6, 32);
    let Some(vw) = view(&s, 0, 0) else {
        return;
    };
    let blocks = s.blocks().unwrap();
    s.migrate(.., Tier::Host).unwrap().wait(None).unwrap();
    e.migrate(&blocks, Tier::Host).unwrap().wait(None).unwrap();
    for b in &blocks {
        let info = e.block_info(*b).unwrap();
        assert_eq!(info.tier, Some(Tier::Device), "a mapped block moved");
        assert!(info.holds >= 1, "{info:?}");
    }
    drop(vw);
    s.migrate(.., Tier::Host).unwrap().wait(None).unwrap();
    for b in &blocks {
        let info = e.block_info(*b).unwrap();
        assert_eq!(info.tier, Some(Tier::Host));
        assert_eq!(info.holds, 0, "the view's hold outlived it");
    }
    check(&s, 6, 0, 32, "after the view");
}

#[test]
fn a_view_slice_is_stable_when_its_sequence_copies_a_shared_block() {
    let e = view_engine();
    let g = *e.geometry();
    // 24 tokens: a full block and a partial one, both mapped.
    let s = filled(&e, 7, 24);
    let Some(vw) = view(&s, 0, 64) else {
        return;
    };
    let k = heads(&vw, false);
    let v = heads(&vw, true);
    // The fork shares both blocks. Appending to the viewed sequence copies
    // its partial block (it is shared), which leaves the fork the only
    // owner of the block the view shows.
    let child = s.fork(1).unwrap();
    s.append(&[8; 8]).unwrap();
    // The fork rewrites the tokens of that block: it must get a copy (or
    // be refused), not write the pages under the view's slices.
    let (ck, cv) = kv(&g, 9, 0, 16, 8);
    match child.write_kv(0, 16, &ck, &cv) {
        Ok(()) => {}
        Err(err) => assert_eq!(err.status(), Status::Busy, "{err}"),
    }
    check_view_slices(&k, &v, &g, 7, 0, 24);
    drop(vw);
    check(&s, 7, 0, 24, "the viewed sequence");
}

#[test]
fn a_view_slice_is_stable_when_truncate_copies_a_shared_last_block() {
    let e = view_engine();
    let g = *e.geometry();
    // 20 tokens mapped: a full block and 4 tokens of the second.
    let s = filled(&e, 7, 20);
    let Some(vw) = view(&s, 0, 64) else {
        return;
    };
    let k = heads(&vw, false);
    let v = heads(&vw, true);
    // Tokens past the view, then a fork sharing both blocks. Cutting
    // inside the shared second block copies it for the viewed sequence,
    // which leaves the fork the only owner of the block the view shows,
    // though the cut lies past every mapped token.
    s.append(&[7; 4]).unwrap();
    write(&s, 7, 20, 4);
    let child = s.fork(1).unwrap();
    s.truncate(22).unwrap();
    // The fork rewrites the mapped tokens of that block: it must get a
    // copy, not write the pages under the view's slices.
    let (ck, cv) = kv(&g, 9, 0, 16, 4);
    child.write_kv(0, 16, &ck, &cv).unwrap();
    check_view_slices(&k, &v, &g, 7, 0, 20);
    drop(vw);
    check(&s, 7, 0, 22, "the viewed sequence");
    let (k2, v2) = child.read_kv_vec::<f32>(0, 16, 4).unwrap();
    assert!(
        bits(&k2) == bits(&ck) && bits(&v2) == bits(&cv),
        "the fork's write was lost"
    );
}

#[test]
fn view_slices_read_on_threads_while_the_owner_appends_truncates_and_frees() {
    let e = view_engine();
    let g = *e.geometry();
    let s = filled(&e, 10, 40);
    let Some(vw) = view(&s, 1, 64) else {
        return;
    };
    let k = heads(&vw, false);
    let v = heads(&vw, true);
    let stop = AtomicBool::new(false);
    let reads = AtomicU64::new(0);
    std::thread::scope(|sc| {
        for _ in 0..2 {
            let (k, v, stop, reads) = (&k, &v, &stop, &reads);
            sc.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    check_view_slices(k, v, &g, 10, 1, 40);
                    reads.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        // The owner shrinks under the view, regrows, rewrites what the
        // view does not map, forks and lets the fork write everywhere.
        for round in 0..30u32 {
            s.truncate(8 + u64::from(round % 3) * 8).unwrap();
            let len = s.len().unwrap();
            s.append(&vec![round as i32; (48 - len) as usize]).unwrap();
            // Tokens below the view's 40 are refused; 40.. are free.
            let (k1, v1) = kv(&g, 11, 1, len, 1);
            assert_eq!(
                s.write_kv(1, len, &k1, &v1).unwrap_err().status(),
                Status::Busy
            );
            write_layer(&s, 11 + round, 1, 40, 8);
            write_layer(&s, 11 + round, 0, 0, 48);
            let child = s.fork(round).unwrap();
            write_layer(&child, 99, 1, 0, 48);
            drop(child);
        }
        while reads.load(Ordering::Relaxed) < 20 {
            std::thread::yield_now();
        }
        // The sequence goes while the readers still read.
        drop(s);
        let seen = reads.load(Ordering::Relaxed);
        while reads.load(Ordering::Relaxed) < seen + 4 {
            std::thread::yield_now();
        }
        stop.store(true, Ordering::Relaxed);
    });
    check_view_slices(&k, &v, &g, 10, 1, 40);
}

fn write_layer(seq: &Sequence<'_>, seed: u32, layer: u32, pos: u64, n: usize) {
    let (k, v) = kv(seq.engine().geometry(), seed, layer, pos, n);
    seq.write_kv(layer, pos, &k, &v).unwrap();
}

/// The blocks of a freed sequence are gone, or cached and referenced by
/// nobody.
fn assert_unreferenced(e: &Engine, blocks: &[Block], what: &str) {
    for b in blocks {
        match e.block_info(*b) {
            Ok(info) => assert!(
                info.refs == 0 && info.holds == 0 && info.pins == 0,
                "{what}: block {b:?} still used: {info:?}"
            ),
            Err(err) => assert_eq!(err.status(), Status::BadHandle, "{err}"),
        }
    }
}

#[test]
fn views_dropped_after_their_sequences_leave_no_block_behind() {
    let e = view_engine();
    let s = filled(&e, 12, 40);
    let Some(v0) = view(&s, 0, 64) else {
        return;
    };
    let v1 = view(&s, 1, 64).unwrap();
    let blocks = s.blocks().unwrap();
    s.truncate(8).unwrap();
    drop(s);
    drop(v0);
    // The other view still shows every block.
    for b in &blocks {
        assert!(e.block_info(*b).unwrap().refs >= 1);
    }
    check_view_slices(
        &heads(&v1, false),
        &heads(&v1, true),
        e.geometry(),
        12,
        1,
        40,
    );
    drop(v1);
    assert_unreferenced(&e, &blocks, "after the last view");
    // The partial block was never published: it is freed, not cached.
    assert_eq!(
        e.block_info(blocks[2]).unwrap_err().status(),
        Status::BadHandle
    );
    assert_eq!(e.tier_info(Tier::Device).unwrap().pinned_blocks, 0);
}

#[test]
fn truncating_again_and_again_under_a_view_does_not_pile_up_blocks() {
    let e = view_engine();
    let s = filled(&e, 13, 24);
    let Some(vw) = view(&s, 0, 64) else {
        return;
    };
    let used = |e: &Engine| {
        e.tier_info(Tier::Device).unwrap().used_blocks
            + e.tier_info(Tier::Host).unwrap().used_blocks
    };
    // The view maps the first two blocks. Each round gives up two blocks
    // that it never mapped (their KV is not even written, so they cannot
    // be cached): nothing but the view's own blocks may stay.
    // 300 rounds give up 600 blocks, more than both tiers hold (512).
    for round in 0..500 {
        s.truncate(0).unwrap();
        if let Err(err) = s.append(&[round; 24]) {
            panic!(
                "round {round}: {err}; {} blocks in use for a view of 2 blocks",
                used(&e)
            );
        }
    }
    let held = used(&e);
    assert!(
        held <= 6,
        "{held} blocks in use for a view of 2 blocks and a sequence of 2"
    );
    drop(vw);
    drop(s);
    assert!(used(&e) <= 2, "{} blocks left", used(&e));
}

#[test]
fn unwinding_with_a_view_of_a_freed_sequence_alive() {
    let e = view_engine();
    let blocks = std::sync::Mutex::new(Vec::new());
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let s = filled(&e, 14, 40);
        *blocks.lock().unwrap() = s.blocks().unwrap();
        let Some(vw) = view(&s, 0, 64) else {
            return;
        };
        let _k = vw.k::<f32>(0).unwrap();
        let _hold = s.acquire(0..16).unwrap();
        let _fence = s.migrate(16.., Tier::Host).unwrap();
        let child = s.fork(1).unwrap();
        let _ = child.truncate(0);
        drop(child);
        panic!("unwinding with a view, a hold and a fence alive");
    }));
    if r.is_ok() {
        return; // no views on this machine
    }
    assert_unreferenced(&e, &blocks.lock().unwrap(), "after unwinding");
    assert_eq!(e.tier_info(Tier::Device).unwrap().pinned_blocks, 0);
    let s = filled(&e, 15, 40);
    let vw = s.vmap(0, 0).unwrap();
    check_view_slices(
        &heads(&vw, false),
        &heads(&vw, true),
        e.geometry(),
        15,
        0,
        40,
    );
}

// ------------------------------------------------------------------ pools

const PL: u32 = 2;
const PH: u32 = 2;
const PD: u32 = 8;
const PBT: u32 = 4;
const SLOT: usize = (PBT * PH * PD) as usize;

fn pool_geometry() -> Geometry {
    *common::engine(PL, PH, PD, PBT, 1, 0).geometry()
}

/// Pool memory of `slots` slots: slot s below `filled` holds K of seed
/// 20 + s (V = -K), the others zeros.
struct Mem {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl Mem {
    fn new(slots: u32, filled: u32) -> Mem {
        let g = pool_geometry();
        let mut k = vec![vec![0f32; SLOT * slots as usize]; PL as usize];
        let mut v = k.clone();
        for l in 0..PL {
            for s in 0..filled {
                let (sk, sv) = kv(&g, 20 + s, l, 0, PBT as usize);
                let r = s as usize * SLOT..(s as usize + 1) * SLOT;
                k[l as usize][r.clone()].copy_from_slice(&sk);
                v[l as usize][r].copy_from_slice(&sv);
            }
        }
        Mem { k, v }
    }

    fn slot(&self, l: u32, s: u32) -> (Vec<u32>, Vec<u32>) {
        let r = s as usize * SLOT..(s as usize + 1) * SLOT;
        (
            bits(&self.k[l as usize][r.clone()]),
            bits(&self.v[l as usize][r]),
        )
    }

    fn ptrs(&mut self) -> (Vec<*mut c_void>, Vec<*mut c_void>) {
        (
            self.k.iter_mut().map(|x| x.as_mut_ptr().cast()).collect(),
            self.v.iter_mut().map(|x| x.as_mut_ptr().cast()).collect(),
        )
    }

    fn register<'e>(&mut self, e: &'e Engine) -> kvh::Result<Pool<'e>> {
        let slots = (self.k[0].len() / SLOT) as u32;
        let (k, v) = self.ptrs();
        let row = u64::from(PD) * 4;
        // SAFETY: every test declares the memory before the pool, so it
        // outlives it, and reads it only after the batches' fences or the
        // pool's drop.
        unsafe { Pool::register(e, &k, &v, slots, SLOT as u64 * 4, u64::from(PH) * row, row) }
    }
}

fn block_tokens(i: u32, salt: i32) -> Vec<i32> {
    (0..PBT as i32).map(|t| salt + 10 * i as i32 + t).collect()
}

/// Offload items of `n` chained blocks from slots first.., hashed in
/// `scope`.
fn chain<'t>(
    e: &Engine,
    toks: &'t [Vec<i32>],
    first_slot: u32,
    scope: u64,
) -> Vec<OffloadItem<'t>> {
    let mut parent = 0u64;
    toks.iter()
        .enumerate()
        .map(|(i, t)| {
            let item = OffloadItem {
                slot: first_slot + i as u32,
                scope,
                parent_hash: parent,
                tokens: t,
            };
            parent = e.prefix_hash_scoped(scope, parent, t).unwrap();
            item
        })
        .collect()
}

#[test]
fn offloaded_pool_blocks_read_back_bit_exact_and_restore_by_layer() {
    let e = common::engine(PL, PH, PD, PBT, 32, 32);
    let mut mem = Mem::new(6, 3);
    let toks: Vec<Vec<i32>> = (0..3).map(|i| block_tokens(i, 500)).collect();
    let blocks;
    {
        let pool = mem.register(&e).unwrap();
        let items = chain(&e, &toks, 0, 0);
        let batch = pool.offload_batch(&items, 3).unwrap();
        batch.wait(None).unwrap();
        assert_eq!(batch.statuses().unwrap(), vec![Status::Ok; 3]);
        blocks = batch.into_blocks();
        // What a sequence finds under those tokens is the pool's KV.
        let s = e.create_sequence(0).unwrap();
        assert_eq!(s.match_prefix(&toks.concat()).unwrap(), 12);
        for l in 0..PL {
            let (k, v) = s.read_kv_vec::<f32>(l, 0, 12).unwrap();
            for i in 0..3u32 {
                let (mk, mv) = kv(&e.geometry().clone(), 20 + i, l, 0, PBT as usize);
                let r = i as usize * SLOT..(i as usize + 1) * SLOT;
                assert!(bits(&k[r.clone()]) == bits(&mk), "K layer {l} block {i}");
                assert!(bits(&v[r]) == bits(&mv), "V layer {l} block {i}");
            }
        }
        // The same chain again is found cached: no copy, the same blocks.
        let before = e.stats().unwrap().blocks_allocated;
        let again = pool.offload_batch(&items, 3).unwrap().into_blocks();
        assert_eq!(e.stats().unwrap().blocks_allocated, before);
        let ids: Vec<Block> = again.iter().map(|b| b.block()).collect();
        let first: Vec<Block> = blocks.iter().map(|b| b.block()).collect();
        assert_eq!(ids, first, "a cached chain offloaded again");
        // Layer 1 only of block 1 into slot 5; all of blocks 2 and 0 into
        // slots 4 and 3.
        let r = pool.restore_batch(&[(blocks[1].block(), 5)], 1, 1).unwrap();
        r.wait_layer(1, None).unwrap();
        assert_eq!(r.wait_layer(0, None).unwrap_err().status(), Status::Range);
        assert_eq!(r.statuses().unwrap(), vec![Status::Ok]);
        drop(r);
        let r = pool
            .restore_batch(&[(blocks[2].block(), 4), (blocks[0].block(), 3)], 0, PL)
            .unwrap();
        r.wait(None).unwrap();
        assert_eq!(r.statuses().unwrap(), vec![Status::Ok; 2]);
    }
    assert_eq!(mem.slot(1, 5), mem.slot(1, 1), "restored layer 1");
    assert!(
        mem.slot(0, 5).0.iter().all(|&b| b == 0),
        "a layer outside the batch was written"
    );
    for l in 0..PL {
        assert_eq!(mem.slot(l, 4), mem.slot(l, 2), "slot 4 layer {l}");
        assert_eq!(mem.slot(l, 3), mem.slot(l, 0), "slot 3 layer {l}");
    }
    drop(blocks);
}

#[test]
fn pool_layouts_the_header_forbids_are_refused() {
    let e = common::engine(PL, PH, PD, PBT, 8, 8);
    let mut mem = Mem::new(4, 0);
    let (k, v) = mem.ptrs();
    let row = u64::from(PD) * 4;
    let good = (4u32, SLOT as u64 * 4, u64::from(PH) * row, row);
    for (i, (slots, slot_stride, token_stride, head_stride)) in [
        (0, good.1, good.2, good.3),
        (4, good.1, row - 1, good.3),
        (4, good.1, good.2, row - 1),
        (4, good.1, good.2, 0),
        (4, u64::MAX / 2, good.2, good.3),
        (u32::MAX, 1 << 40, good.2, good.3),
        (4, good.1, u64::MAX / 2, good.3),
        (4, good.1, good.2, u64::MAX - 8),
    ]
    .into_iter()
    .enumerate()
    {
        // SAFETY: the library must refuse these layouts, so nothing is
        // registered and the memory is never touched.
        let r =
            unsafe { Pool::register(&e, &k, &v, slots, slot_stride, token_stride, head_stride) };
        match r {
            Ok(_) => panic!(
                "layout {i} registered: {slots} slots, strides {slot_stride}/{token_stride}/\
                 {head_stride}"
            ),
            Err(err) => assert_eq!(err.status(), Status::InvalidArg, "layout {i}: {err}"),
        }
    }
    let mut knull = k.clone();
    knull[1] = std::ptr::null_mut();
    // SAFETY: as above (a NULL base pointer is refused).
    let r = unsafe { Pool::register(&e, &knull, &v, good.0, good.1, good.2, good.3) };
    assert_eq!(r.map(|_| ()).unwrap_err().status(), Status::InvalidArg);
    // SAFETY: as above (the wrong number of layers).
    let r = unsafe { Pool::register(&e, &k[..1], &v[..1], good.0, good.1, good.2, good.3) };
    assert_eq!(r.map(|_| ()).unwrap_err().status(), Status::InvalidArg);
    // The good layout still registers.
    // SAFETY: mem outlives the pool; no batch runs.
    let pool = unsafe { Pool::register(&e, &k, &v, good.0, good.1, good.2, good.3) }.unwrap();
    assert_eq!(pool.num_slots(), 4);
}

#[test]
fn restoring_foreign_stale_or_unwritten_blocks_is_refused_and_writes_nothing() {
    let e = common::engine(PL, PH, PD, PBT, 16, 16);
    let other = common::engine(PL, PH, PD, PBT, 16, 16);
    let os = other.create_sequence(0).unwrap();
    os.append(&block_tokens(0, 0)).unwrap();
    write(&os, 1, 0, PBT as usize);
    let foreign = os.blocks().unwrap()[0];
    let stale = {
        let b = e.alloc_block(0).unwrap();
        let id = b.block();
        b.release().unwrap();
        id
    };
    let empty = e.alloc_block(0).unwrap();
    // A full block with one layer of KV written.
    let half = e.create_sequence(0).unwrap();
    half.append(&block_tokens(1, 0)).unwrap();
    write_layer(&half, 2, 0, 0, PBT as usize);
    let half_block = half.blocks().unwrap()[0];
    let mut mem = Mem::new(4, 4);
    let orig = (mem.k.clone(), mem.v.clone());
    {
        let pool = mem.register(&e).unwrap();
        for (what, blk, want) in [
            ("foreign", foreign, Status::BadHandle),
            ("stale", stale, Status::BadHandle),
            ("empty", empty.block(), Status::InvalidArg),
            ("half written", half_block, Status::InvalidArg),
        ] {
            let err = pool.restore_batch(&[(blk, 0)], 0, PL).unwrap_err();
            assert_eq!(err.status(), want, "{what}: {err}");
            // Among good items too: the whole batch is refused.
            let err = pool
                .restore_batch(&[(blk, 1), (foreign, 2)], 0, 1)
                .unwrap_err();
            assert!(
                matches!(err.status(), Status::BadHandle | Status::InvalidArg),
                "{what}: {err}"
            );
        }
        // Forged handles.
        for id in [0u64, 1, u64::MAX] {
            let blk = Block::from_raw(kvh::sys::kvh_block { id });
            assert!(pool.restore_batch(&[(blk, 3)], 0, PL).is_err(), "{id:#x}");
        }
    }
    assert!(
        mem.k == orig.0 && mem.v == orig.1,
        "a refused restore wrote pool memory"
    );
    // The other engine's block is untouched.
    check(&os, 1, 0, PBT as usize, "the other engine's block");
}

#[test]
fn pool_batches_from_two_threads_stay_exact() {
    let e = common::engine(PL, PH, PD, PBT, 64, 64);
    let mut mem = Mem::new(8, 8);
    let orig = (mem.k.clone(), mem.v.clone());
    let toks: Vec<Vec<Vec<i32>>> = (0..2)
        .map(|t| (0..4).map(|i| block_tokens(i, 1000 * (t + 1))).collect())
        .collect();
    {
        let pool = mem.register(&e).unwrap();
        std::thread::scope(|sc| {
            for t in 0..2u32 {
                let (pool, e, toks) = (&pool, &e, &toks[t as usize]);
                sc.spawn(move || {
                    // Each thread owns slots 4t..4t+4: offloads them and
                    // restores them in place (the same bytes) many times.
                    let items = chain(e, toks, 4 * t, 0);
                    for round in 0..25 {
                        let batch = pool.offload_batch(&items, t).unwrap();
                        batch.wait(None).unwrap();
                        assert_eq!(batch.statuses().unwrap(), vec![Status::Ok; 4]);
                        let blocks = batch.into_blocks();
                        let pairs: Vec<(Block, u32)> = blocks
                            .iter()
                            .enumerate()
                            .map(|(i, b)| (b.block(), 4 * t + i as u32))
                            .collect();
                        let r = pool.restore_batch(&pairs, 0, PL).unwrap();
                        if round % 2 == 0 {
                            r.wait_layer(PL - 1, None).unwrap();
                        }
                        drop(r); // waits
                    }
                });
            }
        });
    }
    assert!(mem.k == orig.0 && mem.v == orig.1, "pool bytes changed");
    for (t, chain_toks) in toks.iter().enumerate() {
        let s = e.create_sequence(0).unwrap();
        assert_eq!(s.match_prefix(&chain_toks.concat()).unwrap(), 16);
        for l in 0..PL {
            let (k, _) = s.read_kv_vec::<f32>(l, 0, 16).unwrap();
            let want: Vec<f32> = (0..4)
                .flat_map(|i| kv(e.geometry(), 20 + 4 * t as u32 + i, l, 0, PBT as usize).0)
                .collect();
            assert!(bits(&k) == bits(&want), "thread {t} layer {l}");
        }
    }
}

#[test]
fn a_pool_dropped_under_queued_batches_ends_them_cleanly() {
    let e = Engine::open(
        Config::new()
            .backend(Backend::Cpu)
            .dtype(DType::F32)
            .num_layers(PL)
            .num_kv_heads(PH)
            .head_dim(PD)
            .block_tokens(PBT)
            .device_bytes(256 * 2 * SLOT as u64 * 4 * u64::from(PL))
            .host_bytes(0)
            .migration_threads(1),
    )
    .unwrap();
    const N: u32 = 64;
    let mut mem = Mem::new(N, N);
    let toks: Vec<Vec<i32>> = (0..N).map(|i| block_tokens(i, 7000)).collect();
    for round in 0..4 {
        let pool = mem.register(&e).unwrap();
        let items = chain(&e, &toks[(round * 8) as usize..], 0, 0);
        let items = &items[..(N - round * 8) as usize];
        let batch = pool.offload_batch(items, 0).unwrap();
        let batch2 = pool.offload_batch(&[], 0).unwrap();
        drop(pool); // waits for running batches; queued ones end Bad handle
        let r = batch.wait(None);
        let st = batch.statuses().unwrap();
        for (i, s) in st.iter().enumerate() {
            assert!(
                matches!(s, Status::Ok | Status::BadHandle),
                "item {i}: {s:?}"
            );
        }
        if st.iter().all(|s| *s == Status::Ok) {
            r.unwrap();
        }
        batch2.wait(None).unwrap();
        // Items that made it hold the slot's bytes.
        let ok: Vec<usize> = (0..st.len()).filter(|&i| st[i] == Status::Ok).collect();
        let blocks = batch.into_blocks();
        for &i in &ok {
            assert!(blocks[i].info().unwrap().published, "item {i}");
        }
        if ok.len() == st.len() {
            let s = e.create_sequence(0).unwrap();
            let all: Vec<i32> = toks[(round * 8) as usize..].concat();
            assert_eq!(s.match_prefix(&all).unwrap(), st.len() * PBT as usize);
            let (k, _) = s.read_kv_vec::<f32>(1, 0, PBT as usize).unwrap();
            assert!(bits(&k) == bits(&kv(e.geometry(), 20, 1, 0, PBT as usize).0));
        }
    }
}

// --------------------------------------------------------------- contexts

#[test]
fn context_misuse_is_refused_and_the_engine_stays_usable() {
    let e = common::context_engine();
    let data: Vec<u8> = (0..10_000u32).map(|i| (i * 13 % 251) as u8).collect();
    let a = e.create_context("a", KvPolicy::Keep).unwrap();
    assert_eq!(a.add_region_bytes("w", 0, &data).unwrap(), 0);
    // Not resident before a switch brings it.
    assert_eq!(a.region_bytes(0).unwrap_err().status(), Status::NotResident);
    assert_eq!(a.region_bytes(1).unwrap_err().status(), Status::Range);
    assert_eq!(a.region_ptr(u32::MAX).unwrap_err().status(), Status::Range);
    assert_eq!(a.pin(1, true).unwrap_err().status(), Status::Range);
    assert_eq!(
        a.wait_layer(0, Some(Duration::from_millis(50)))
            .unwrap_err()
            .status(),
        Status::NotResident
    );
    assert_eq!(
        e.switch_context(Some(&a), Some(&a)).unwrap_err().status(),
        Status::InvalidArg
    );
    // Files that cannot be a region.
    let tmp = TempDir::new("ctx");
    let dir = tmp.0.clone();
    let file = dir.join("w.bin");
    std::fs::write(&file, &data).unwrap();
    for (what, path, off, size) in [
        ("missing", dir.join("none"), 0, 10),
        ("directory", dir.clone(), 0, 10),
        ("short", file.clone(), 9_000, 2_000),
        ("offset past the end", file.clone(), u64::MAX - 4, 10),
    ] {
        let err = a.add_region_file("f", 1, &path, off, size).unwrap_err();
        assert!(
            matches!(err.status(), Status::Io | Status::InvalidArg),
            "{what}: {err}"
        );
    }
    let err = a.add_region_file("f", 1, &file, 0, 0).unwrap_err();
    assert_eq!(err.status(), Status::InvalidArg);
    assert_eq!(a.info().unwrap().regions, 1, "a refused region was added");
    // A context too large for the device tier: the switch fails, and
    // nothing else changes.
    let big = e.create_context("big", KvPolicy::Keep).unwrap();
    let huge = vec![5u8; 300 << 10];
    match big.add_region_bytes("w", 0, &huge) {
        Ok(_) => {
            let err = e.switch_context(None, Some(&big)).unwrap_err();
            assert_eq!(err.status(), Status::NoSpace, "{err}");
        }
        Err(err) => assert_eq!(err.status(), Status::NoSpace, "{err}"),
    }
    e.switch_context(None, Some(&a)).unwrap();
    assert_eq!(a.region_bytes(0).unwrap(), data);
    let f = a.add_region_file("f", 1, &file, 100, 5_000).unwrap();
    // A file name that is not UTF-8 is still a Linux path.
    let odd = {
        use std::os::unix::ffi::OsStrExt;
        dir.join(std::ffi::OsStr::from_bytes(b"w\xff.bin"))
    };
    std::fs::write(&odd, &data).unwrap();
    let g = a.add_region_file("g", 1, &odd, 0, 100).unwrap();
    e.switch_context(Some(&a), None).unwrap();
    e.switch_context(None, Some(&a)).unwrap();
    assert_eq!(a.region_bytes(f).unwrap(), &data[100..5_100]);
    assert_eq!(a.region_bytes(g).unwrap(), &data[..100]);
    assert!(a.verify().unwrap() >= 2);
    let s = e.create_sequence(0).unwrap();
    s.append(&[1; 8]).unwrap();
    write(&s, 3, 0, 8);
    check(&s, 3, 0, 8, "KV next to weights");
}

#[test]
fn region_bytes_during_an_async_switch_away_are_exact_or_refused() {
    // A read of freed memory may fault: in a child process.
    let (code, text) = common::run_child(
        CHILD_VAR,
        "region_bytes_during_switch",
        Duration::from_secs(60),
        None,
    );
    assert_eq!(code, Some(0), "child case failed:\n{text}");
    assert!(text.contains("1 passed"), "child case did not run:\n{text}");
}

fn child_region_bytes_during_switch() {
    // Regions from files, a device tier that holds one context and a host
    // tier too small to keep the leaving one: a switch drops the leaving
    // context's regions and the arriving context's take their memory.
    const REGION: usize = 1 << 20;
    let e = Engine::open(
        Config::new()
            .backend(Backend::Cpu)
            .dtype(DType::F32)
            .head_dim(8)
            .block_tokens(4)
            .device_bytes(4 * REGION as u64 + (64 << 10))
            .host_bytes(16 << 10),
    )
    .unwrap();
    let tmp = TempDir::new("sw");
    let dir = tmp.0.clone();
    let fa = dir.join("a.bin");
    let fb = dir.join("b.bin");
    let da: Vec<u8> = (0..4 * REGION as u32).map(|i| (i % 251) as u8).collect();
    let db: Vec<u8> = (0..4 * REGION as u32)
        .map(|i| 255 - (i % 241) as u8)
        .collect();
    std::fs::write(&fa, &da).unwrap();
    std::fs::write(&fb, &db).unwrap();
    let a = e.create_context("a", KvPolicy::Keep).unwrap();
    let b = e.create_context("b", KvPolicy::Keep).unwrap();
    for l in 0..4u32 {
        let at = u64::from(l) * REGION as u64;
        a.add_region_file("a", l, &fa, at, REGION as u64).unwrap();
        b.add_region_file("b", l, &fb, at, REGION as u64).unwrap();
    }
    e.switch_context(None, Some(&a)).unwrap();
    let mut seen_refused = 0;
    // A race: rounds for a few seconds, so that a wrong read is all but
    // certain where a switch can free memory under a read.
    let start = std::time::Instant::now();
    let mut round = 0u64;
    while round < 3000 && (round < 20 || start.elapsed() < Duration::from_secs(10)) {
        round += 1;
        let (from, to, want) = if round % 2 == 1 {
            (&a, &b, &da)
        } else {
            (&b, &a, &db)
        };
        let f = e.switch_context_async(Some(from), Some(to)).unwrap();
        // The leaving context's bytes while the switch runs (the last
        // layers leave first): what it holds, or a refusal.
        for (i, r) in [3u32, 2, 1, 0].into_iter().cycle().take(64).enumerate() {
            if i >= 4 && f.poll().unwrap() {
                break;
            }
            match from.region_bytes(r) {
                Ok(bytes) => {
                    let at = r as usize * REGION;
                    let wrong = bytes
                        .iter()
                        .zip(&want[at..at + REGION])
                        .filter(|(x, y)| x != y)
                        .count();
                    assert!(
                        bytes.len() == REGION && wrong == 0,
                        "round {round} region {r}: {wrong} of {} bytes read from a context \
                         being switched away are not its own",
                        bytes.len()
                    );
                }
                Err(err) => {
                    assert!(
                        matches!(err.status(), Status::NotResident | Status::Busy),
                        "{err}"
                    );
                    seen_refused += 1;
                }
            }
        }
        f.wait(Some(Duration::from_secs(20))).unwrap();
        assert_eq!(
            from.region_bytes(0).unwrap_err().status(),
            Status::NotResident
        );
        assert!(to.region_bytes(3).unwrap() == want_of(&da, &db, to, &a)[3 * REGION..]);
    }
    assert!(seen_refused > 0, "no read raced a switch");
    assert_eq!(e.weight_stats().unwrap().switches, round + 1);
}

/// The file bytes of context `c`: `da` for `a`, else `db`.
fn want_of<'d>(da: &'d [u8], db: &'d [u8], c: &kvh::Context<'_>, a: &kvh::Context<'_>) -> &'d [u8] {
    if std::ptr::eq(c, a) {
        da
    } else {
        db
    }
}

#[test]
fn a_context_moved_to_another_thread_and_back() {
    let e = common::context_engine();
    let data: Vec<u8> = (0..20_000u32).map(|i| (i * 7 % 253) as u8).collect();
    let ctx = e.create_context("moved", KvPolicy::Demote).unwrap();
    let s = e.create_sequence(0).unwrap();
    s.append(&[2; 12]).unwrap();
    write(&s, 4, 0, 12);
    ctx.attach(&s).unwrap();
    let gone = e.create_sequence(0).unwrap();
    gone.append(&[3; 4]).unwrap();
    ctx.attach(&gone).unwrap();
    assert_eq!(ctx.info().unwrap().seqs, 2);
    drop(gone);
    assert_eq!(
        ctx.info().unwrap().seqs,
        1,
        "a freed sequence still counted"
    );
    // Context is Send: regions are added and the switch made over there.
    let ctx = std::thread::scope(|sc| {
        let data = &data;
        let e = &e;
        sc.spawn(move || {
            ctx.add_region_bytes("w", 0, data).unwrap();
            e.switch_context(None, Some(&ctx)).unwrap();
            ctx
        })
        .join()
        .unwrap()
    });
    assert_eq!(ctx.region_bytes(0).unwrap(), data);
    // Away and back: the attached sequence's KV left and came back intact.
    e.switch_context(Some(&ctx), None).unwrap();
    e.switch_context(None, Some(&ctx)).unwrap();
    check(&s, 4, 0, 12, "KV of a demoted context");
    assert_eq!(e.weight_stats().unwrap().switches, 3);
    // Dropped on another thread, with the sequence still attached.
    std::thread::scope(|sc| {
        sc.spawn(move || drop(ctx));
    });
    check(&s, 4, 0, 12, "after the context was destroyed");
}

// -------------------------------------------------------------- latencies

fn assert_histogram_consistent(h: &LatencyHistogram) {
    assert_eq!(
        h.count,
        h.counts.iter().sum::<u64>(),
        "{:?}: count is not the sum of its buckets",
        h.kind
    );
    // Each sample of bucket i > 0 took more than bucket i-1's bound.
    let floor: u64 = (1..LATENCY_BUCKETS)
        .map(|i| h.counts[i] * LatencyHistogram::bound_ns(i - 1).unwrap())
        .sum();
    assert!(
        h.sum_ns >= floor,
        "{:?}: sum_ns {} < {floor}",
        h.kind,
        h.sum_ns
    );
    if h.counts[LATENCY_BUCKETS - 1] == 0 {
        let ceil: u64 = (0..LATENCY_BUCKETS - 1)
            .map(|i| h.counts[i] * LatencyHistogram::bound_ns(i).unwrap())
            .sum();
        assert!(
            h.sum_ns <= ceil,
            "{:?}: sum_ns {} > {ceil}",
            h.kind,
            h.sum_ns
        );
    }
}

#[test]
fn acquire_stalls_counted_exactly_under_concurrent_acquires() {
    let e = common::engine(1, 2, 8, 4, 64, 64);
    let before = e.stats().unwrap().acquire_stall_ns;
    let stop = AtomicBool::new(false);
    const ROUNDS: u64 = 30;
    std::thread::scope(|sc| {
        let (e, stop) = (&e, &stop);
        let watcher = sc.spawn(move || {
            let mut last = 0;
            while !stop.load(Ordering::Relaxed) {
                let h = e.latency_histogram(LatencyKind::AcquireStall).unwrap();
                assert_eq!(h.count, h.counts.iter().sum::<u64>());
                assert!(h.count >= last, "the count went down");
                last = h.count;
                std::thread::sleep(Duration::from_micros(200));
            }
        });
        let workers: Vec<_> = (0..2u32)
            .map(|t| {
                sc.spawn(move || {
                    let s = e.create_sequence(t).unwrap();
                    s.append(&[t as i32; 16]).unwrap();
                    write(&s, t, 0, 16);
                    for _ in 0..ROUNDS {
                        s.migrate(.., Tier::Host).unwrap().wait(None).unwrap();
                        s.acquire(..).unwrap().release().unwrap(); // stalls
                        s.acquire(..).unwrap().release().unwrap(); // resident
                                                                   // An acquire with a fence is not timed.
                        s.migrate(.., Tier::Host).unwrap().wait(None).unwrap();
                        let (hold, f) = s.acquire_async(..).unwrap();
                        f.wait(None).unwrap();
                        hold.release().unwrap();
                    }
                    check(&s, t, 0, 16, "after the stalls");
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        watcher.join().unwrap();
    });
    let h = e.latency_histogram(LatencyKind::AcquireStall).unwrap();
    assert_eq!(h.count, 2 * ROUNDS, "{h:?}");
    assert_eq!(h.sum_ns, e.stats().unwrap().acquire_stall_ns - before);
    assert_histogram_consistent(&h);
    for kind in [LatencyKind::DiskRead, LatencyKind::DiskWrite] {
        let h = e.latency_histogram(kind).unwrap();
        assert_eq!((h.count, h.sum_ns), (0, 0), "{kind:?} without a disk tier");
    }
}

#[test]
fn disk_latencies_count_the_blocks_moved() {
    let tmp = TempDir::new("disk");
    let dir = tmp.0.clone();
    let e = match Engine::open(
        Config::new()
            .backend(Backend::Cpu)
            .dtype(DType::F32)
            .num_layers(1)
            .num_kv_heads(2)
            .head_dim(8)
            .block_tokens(4)
            .device_bytes(64 << 10)
            .host_bytes(64 << 10)
            .disk(&dir, 4 << 20),
    ) {
        Ok(e) => e,
        Err(err) if err.status() == Status::Unsupported => return,
        Err(err) => panic!("open with a disk tier: {err}"),
    };
    let s = e.create_sequence(0).unwrap();
    s.append(&(0..16).collect::<Vec<i32>>()).unwrap();
    write(&s, 8, 0, 16);
    s.migrate(.., Tier::Disk).unwrap().wait(None).unwrap();
    let w = e.latency_histogram(LatencyKind::DiskWrite).unwrap();
    assert!(w.count >= 4, "{w:?}");
    assert_histogram_consistent(&w);
    let stall = e
        .latency_histogram(LatencyKind::AcquireStall)
        .unwrap()
        .count;
    drop(s.acquire(..).unwrap());
    let r = e.latency_histogram(LatencyKind::DiskRead).unwrap();
    assert!(r.count >= 4, "{r:?}");
    assert_histogram_consistent(&r);
    assert_eq!(
        e.latency_histogram(LatencyKind::AcquireStall)
            .unwrap()
            .count,
        stall + 1
    );
    check(&s, 8, 0, 16, "back from disk");
    drop(s);
    drop(e);
}

// ---------------------------------------------------- fences and migration

#[test]
fn migrations_and_fences_at_the_edges() {
    let e = common::engine(2, 2, 8, 4, 16, 64);
    let s = e.create_sequence(0).unwrap();
    s.append(&[1; 32]).unwrap();
    write(&s, 3, 0, 32);
    let blocks = s.blocks().unwrap();
    // A tier the engine does not have.
    assert_eq!(
        s.migrate(.., Tier::Disk).unwrap_err().status(),
        Status::InvalidArg
    );
    assert_eq!(
        e.migrate(&blocks, Tier::Disk).unwrap_err().status(),
        Status::InvalidArg
    );
    // A stale handle among good ones: nothing moves.
    let stale = {
        let b = e.alloc_block(0).unwrap();
        let id = b.block();
        b.release().unwrap();
        id
    };
    assert_eq!(
        e.migrate(&[blocks[0], stale, blocks[1]], Tier::Host)
            .unwrap_err()
            .status(),
        Status::BadHandle
    );
    assert_eq!(
        e.block_info(blocks[0]).unwrap().tier,
        Some(Tier::Device),
        "a refused migration moved a block"
    );
    // The same block listed many times.
    e.migrate(
        &[blocks[0], blocks[0], blocks[1], blocks[0], blocks[1]],
        Tier::Host,
    )
    .unwrap()
    .wait(None)
    .unwrap();
    for b in &blocks[..2] {
        assert_eq!(e.block_info(*b).unwrap().tier, Some(Tier::Host));
    }
    check(&s, 3, 0, 32, "after duplicate moves");
    // Pinned blocks stay.
    drop(s.acquire(..).unwrap());
    s.pin(0..4).unwrap();
    s.migrate(.., Tier::Host).unwrap().wait(None).unwrap();
    assert_eq!(e.block_info(blocks[0]).unwrap().tier, Some(Tier::Device));
    assert_eq!(e.block_info(blocks[1]).unwrap().tier, Some(Tier::Host));
    s.unpin(0..4).unwrap();
    assert_eq!(s.unpin(0..4).unwrap_err().status(), Status::InvalidArg);
    // Fences dropped before their work ends: the work still ends.
    for _ in 0..10 {
        drop(s.migrate(.., Tier::Device).unwrap());
        drop(s.migrate(.., Tier::Host).unwrap());
    }
    let f = s.migrate(.., Tier::Device).unwrap();
    match f.wait(Some(Duration::ZERO)) {
        Ok(()) => {}
        Err(err) => assert_eq!(err.status(), Status::Timeout, "{err}"),
    }
    f.wait(None).unwrap();
    assert!(f.poll().unwrap());
    f.wait(Some(Duration::ZERO)).unwrap();
    check(&s, 3, 0, 32, "after dropped fences");
    // A hold dropped before its fence completes leaves no hold behind.
    s.migrate(.., Tier::Host).unwrap().wait(None).unwrap();
    let (hold, f) = s.acquire_async(..).unwrap();
    drop(hold);
    let _ = f.wait(None);
    for b in &blocks {
        assert_eq!(e.block_info(*b).unwrap().holds, 0);
    }
    // Prefetches of nothing, and at the priority extremes.
    let len = s.len().unwrap();
    s.prefetch_with_fence(len..len, 0)
        .unwrap()
        .wait(None)
        .unwrap();
    for p in [i32::MIN, i32::MAX] {
        s.prefetch_with_fence(.., p).unwrap().wait(None).unwrap();
        s.hint(.., p).unwrap();
    }
    // Migrating a sequence that is freed before the move ends.
    let t = e.create_sequence(0).unwrap();
    t.append(&[2; 32]).unwrap();
    write(&t, 4, 0, 32);
    let tb = t.blocks().unwrap();
    let f = t.migrate(.., Tier::Host).unwrap();
    drop(t);
    if let Err(err) = f.wait(Some(Duration::from_secs(10))) {
        assert!(
            matches!(err.status(), Status::BadHandle | Status::Busy),
            "{err}"
        );
    }
    assert!(f.poll().map_or(true, |done| done));
    assert_unreferenced(&e, &tb, "a freed sequence's moved blocks");
    check(&s, 3, 0, 32, "at the end");
}

#[test]
fn migrations_from_threads_race_the_owner_rewriting() {
    let e = common::engine(2, 2, 8, 4, 8, 64);
    let s = e.create_sequence(0).unwrap();
    s.append(&[1; 48]).unwrap();
    write(&s, 5, 0, 48);
    let shared = s.shared();
    let stop = AtomicBool::new(false);
    std::thread::scope(|sc| {
        for t in 0..2 {
            let (stop, e) = (&stop, &e);
            sc.spawn(move || {
                let mut i = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    let tier = if (i + t) % 2 == 0 {
                        Tier::Host
                    } else {
                        Tier::Device
                    };
                    if let Ok(f) = shared.migrate(0..48, tier) {
                        if let Err(err) = f.wait(Some(Duration::from_secs(10))) {
                            assert!(
                                matches!(err.status(), Status::NoSpace | Status::Busy),
                                "{err}"
                            );
                        }
                    }
                    let _ = shared
                        .prefetch_with_fence(0..16, i as i32)
                        .map(|f| f.wait(None));
                    let _ = e.stats().unwrap();
                    i += 1;
                }
            });
        }
        for round in 0..40u32 {
            // The first 16 tokens never change; the rest are rewritten.
            let (k, v) = kv(e.geometry(), 30 + round, round % 2, 16, 32);
            s.write_kv(round % 2, 16, &k, &v).unwrap();
            let (k2, v2) = s.read_kv_vec::<f32>(round % 2, 16, 32).unwrap();
            assert!(
                bits(&k) == bits(&k2) && bits(&v) == bits(&v2),
                "round {round}"
            );
            check(&s, 5, 0, 16, "the untouched prefix");
        }
        stop.store(true, Ordering::Relaxed);
    });
}

// ------------------------------------------------------------ queue hints

#[test]
fn the_step_count_is_exact_under_racing_advances() {
    let e = common::engine(1, 1, 4, 4, 16, 16);
    let s = e.create_sequence(0).unwrap();
    s.append(&(0..32).collect::<Vec<i32>>()).unwrap();
    let shared = s.shared();
    const PER: u64 = 1000;
    let steps: Vec<Vec<u64>> = std::thread::scope(|sc| {
        let hinter = sc.spawn(move || {
            for p in 0..500u64 {
                shared.hint_at_position(0..32, p % 64).unwrap();
                shared.hint_for_request(4..8, p).unwrap();
            }
        });
        let advancers: Vec<_> = (0..2)
            .map(|_| {
                let e = &e;
                sc.spawn(move || (0..PER).map(|_| e.hint_advance(1).unwrap()).collect())
            })
            .collect();
        hinter.join().unwrap();
        advancers.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let all: HashSet<u64> = steps.iter().flatten().copied().collect();
    assert_eq!(all.len() as u64, 2 * PER, "two advances saw the same step");
    assert_eq!(all, (1..=2 * PER).collect::<HashSet<u64>>());
    let step = e.hint_advance(0).unwrap();
    assert_eq!(step, 2 * PER);
    // 2^24 ahead of the step is the first request refused, by number and
    // by position alike; requests already taken are ignored.
    s.hint_for_request(.., step + (1 << 24) - 1).unwrap();
    assert_eq!(
        s.hint_for_request(.., step + (1 << 24))
            .unwrap_err()
            .status(),
        Status::Range
    );
    assert_eq!(
        s.hint_for_request(.., u64::MAX).unwrap_err().status(),
        Status::Range
    );
    s.hint_at_position(.., (1 << 24) - 1).unwrap();
    assert_eq!(
        s.hint_at_position(.., u64::MAX).unwrap_err().status(),
        Status::Range
    );
    s.hint_for_request(.., 0).unwrap();
    s.hint_for_request(.., step - 1).unwrap();
    assert_eq!(
        s.hint_at_position(32..33, 0).unwrap_err().status(),
        Status::Range
    );
    assert_eq!(
        s.hint_at_position(u64::MAX.., 0).unwrap_err().status(),
        Status::Range
    );
    // Hints racing truncation: only Ok or Range.
    let shared = s.shared();
    std::thread::scope(|sc| {
        let h = sc.spawn(move || {
            for p in 0..400u64 {
                if let Err(err) = shared.hint_at_position(20..28, p % 8) {
                    assert_eq!(err.status(), Status::Range, "{err}");
                }
            }
        });
        for i in 0..100 {
            s.truncate(8 + (i % 4) * 8).unwrap();
            let len = s.len().unwrap();
            s.append(&vec![1; (32 - len) as usize]).unwrap();
        }
        h.join().unwrap();
    });
}

// ----------------------------------------------------------------- scopes

#[test]
fn offloads_in_a_scope_are_found_only_in_that_scope() {
    let e = common::engine(PL, PH, PD, PBT, 32, 32);
    let mut mem = Mem::new(4, 4);
    let toks: Vec<Vec<i32>> = (0..2).map(|i| block_tokens(i, 300)).collect();
    let all = toks.concat();
    let pool = mem.register(&e).unwrap();
    let scoped = pool
        .offload_batch(&chain(&e, &toks, 0, 7), 0)
        .unwrap()
        .into_blocks();
    let h0 = e.prefix_hash_scoped(7, 0, &toks[0]).unwrap();
    let h1 = e.prefix_hash_scoped(7, h0, &toks[1]).unwrap();
    assert_eq!(scoped[1].info().unwrap().hash, h1);
    assert!(e.prefix_lookup(&all).unwrap().is_empty());
    assert!(e
        .prefix_lookup_scoped(Scope::new(8), &all)
        .unwrap()
        .is_empty());
    assert_eq!(
        e.prefix_lookup_scoped(Scope::new(7), &all).unwrap().len(),
        2
    );
    let plain = e.create_sequence(0).unwrap();
    assert_eq!(plain.match_prefix(&all).unwrap(), 0);
    let tenant = e.create_sequence_in(0, Scope::new(7)).unwrap();
    assert_eq!(tenant.match_prefix(&all).unwrap(), 8);
    for l in 0..PL {
        let (k, v) = tenant.read_kv_vec::<f32>(l, 0, 4).unwrap();
        let (mk, mv) = mem.slot(l, 0);
        assert!(bits(&k) == mk && bits(&v) == mv, "layer {l}");
    }
    // The same chain in the default scope is a different pair of blocks.
    let dflt = pool
        .offload_batch(&chain(&e, &toks, 2, 0), 0)
        .unwrap()
        .into_blocks();
    for (a, b) in scoped.iter().zip(&dflt) {
        assert_ne!(a.block(), b.block(), "a block shared across scopes");
    }
    assert_eq!(plain.match_prefix(&all).unwrap(), 8);
    // The fork of a tenant stays in its scope.
    let child = tenant.fork(1).unwrap();
    assert_eq!(child.scope().unwrap(), Scope::new(7));
    drop(pool);
}
