//! Prefix matching across agents.

mod common;

use kvh::Status;

const BT: u32 = 4;

fn system_prompt() -> Vec<i32> {
    (1000..1010).collect() // 2 full blocks + 2 tokens
}

#[test]
fn agents_share_a_system_prompt() {
    let e = common::engine(2, 2, 4, BT, 32, 32);
    let prompt = system_prompt();
    let a = e.create_sequence(1).unwrap();
    a.append(&prompt).unwrap();
    common::fill(&e, &a, 1);
    let a_blocks = a.blocks().unwrap();
    assert!(e.block_info(a_blocks[0]).unwrap().published);
    assert!(e.block_info(a_blocks[1]).unwrap().published);
    assert!(
        !e.block_info(a_blocks[2]).unwrap().published,
        "partial blocks are not cached"
    );

    let before = e.stats().unwrap();
    let agents: Vec<_> = (2..5).map(|id| e.create_sequence(id).unwrap()).collect();
    for (i, s) in agents.iter().enumerate() {
        let matched = s.match_prefix(&prompt).unwrap();
        assert_eq!(matched, 8, "agent {i}: only whole blocks match");
        assert_eq!(s.len().unwrap(), 8);
        assert_eq!(s.blocks().unwrap()[..], a_blocks[..2]);
        // The caller appends (and computes) the rest itself.
        s.append(&prompt[matched..]).unwrap();
        assert_eq!(s.tokens().unwrap(), prompt);
    }
    let after = e.stats().unwrap();
    assert_eq!(after.prefix_queries - before.prefix_queries, 3);
    assert_eq!(after.prefix_hit_blocks - before.prefix_hit_blocks, 6);
    assert_eq!(after.prefix_hit_tokens - before.prefix_hit_tokens, 24);
    assert_eq!(e.block_info(a_blocks[0]).unwrap().refs, 4);

    // The matched KV is agent 1's.
    let per = e.geometry().token_elems();
    for layer in 0..2 {
        let (k, v) = common::kv(&e, 1, layer, 0, 8);
        let (k2, v2) = agents[1].read_kv_vec::<f32>(layer, 0, 8).unwrap();
        assert_eq!(k2.len(), 8 * per);
        assert_eq!((k, v), (k2, v2));
    }
}

#[test]
fn a_different_suffix_matches_the_common_blocks_only() {
    let e = common::engine(1, 1, 4, BT, 32, 0);
    let a = e.create_sequence(1).unwrap();
    a.append(&(0..12).collect::<Vec<_>>()).unwrap();
    common::fill(&e, &a, 1);
    let mut other: Vec<i32> = (0..12).collect();
    other[6] = -1; // differs inside block 1
    let b = e.create_sequence(2).unwrap();
    assert_eq!(b.match_prefix(&other).unwrap(), 4);
    let c = e.create_sequence(3).unwrap();
    assert_eq!(c.match_prefix(&[7, 7, 7, 7, 7]).unwrap(), 0);
    assert!(c.is_empty().unwrap());
}

#[test]
fn blocks_without_complete_kv_are_not_matched() {
    let e = common::engine(2, 1, 4, BT, 32, 0);
    let a = e.create_sequence(1).unwrap();
    a.append(&[5; 8]).unwrap();
    let (k, v) = common::kv(&e, 1, 0, 0, 8);
    a.write_kv(0, 0, &k, &v).unwrap(); // layer 1 missing
    let b = e.create_sequence(2).unwrap();
    assert_eq!(b.match_prefix(&[5; 8]).unwrap(), 0);
    drop(b);
    let (k, v) = common::kv(&e, 1, 1, 0, 8);
    a.write_kv(1, 0, &k, &v).unwrap();
    let b = e.create_sequence(2).unwrap();
    assert_eq!(b.match_prefix(&[5; 8]).unwrap(), 8);
}

#[test]
fn match_prefix_needs_an_empty_sequence() {
    let e = common::engine(1, 1, 4, BT, 8, 0);
    let s = e.create_sequence(0).unwrap();
    s.append(&[1]).unwrap();
    let err = s.match_prefix(&[1, 2, 3, 4]).unwrap_err();
    assert_eq!(err.status(), Status::InvalidArg);
}

#[test]
fn cached_blocks_outlive_their_sequence() {
    let e = common::engine(1, 1, 4, BT, 32, 0);
    let prompt: Vec<i32> = (0..8).collect();
    {
        let a = e.create_sequence(1).unwrap();
        a.append(&prompt).unwrap();
        common::fill(&e, &a, 6);
    }
    let b = e.create_sequence(2).unwrap();
    assert_eq!(b.match_prefix(&prompt).unwrap(), 8);
    let (k, v) = common::kv(&e, 6, 0, 0, 8);
    assert_eq!(b.read_kv_vec::<f32>(0, 0, 8).unwrap(), (k, v));
}

#[test]
fn prefix_hashes_chain_and_lookup_retains() {
    let e = common::engine(1, 1, 4, BT, 32, 0);
    let prompt: Vec<i32> = (0..10).collect();
    let a = e.create_sequence(1).unwrap();
    a.append(&prompt).unwrap();
    common::fill(&e, &a, 1);
    let blocks = a.blocks().unwrap();
    let h0 = e.prefix_hash(0, &prompt[0..4]).unwrap();
    let h1 = e.prefix_hash(h0, &prompt[4..8]).unwrap();
    assert_eq!(e.block_info(blocks[0]).unwrap().hash, h0);
    assert_eq!(e.block_info(blocks[1]).unwrap().hash, h1);
    assert_ne!(h0, h1);
    assert_eq!(
        e.prefix_hash(0, &prompt[0..3]).unwrap_err().status(),
        Status::InvalidArg
    );

    let found = e.prefix_lookup(&prompt).unwrap();
    assert_eq!(found.len(), 2);
    assert_eq!(found[0].block(), blocks[0]);
    assert_eq!(found[1].block(), blocks[1]);
    assert_eq!(found[0].info().unwrap().refs, 2);
    drop(found);
    assert_eq!(e.block_info(blocks[0]).unwrap().refs, 1);
    assert!(e.prefix_lookup(&prompt[..3]).unwrap().is_empty());
}

#[test]
fn model_salt_separates_namespaces() {
    use kvh::{Backend, Config, DType, Engine};
    let open = |salt| {
        Engine::open(
            Config::new()
                .backend(Backend::Cpu)
                .dtype(DType::F32)
                .head_dim(4)
                .block_tokens(BT)
                .model_salt(salt)
                .device_bytes(1 << 20)
                .host_bytes(0),
        )
        .unwrap()
    };
    let (x, y) = (open(1), open(2));
    let toks = [1, 2, 3, 4];
    assert_ne!(
        x.prefix_hash(0, &toks).unwrap(),
        y.prefix_hash(0, &toks).unwrap()
    );
}
