//! Error mapping: every status of KVH_STATUS_LIST, and real failures.

mod common;

use kvh::{Backend, Config, DType, Engine, Error, Status, Tier};

/// (name, value, description) of every X(...) entry of KVH_STATUS_LIST in
/// the header, read from the header itself so a code added there fails
/// this test until `Status` knows it.
fn header_statuses() -> Vec<(String, i32, String)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../abi/include/kvh/kvh.h");
    let text = std::fs::read_to_string(path).expect("read kvh.h");
    let start = text
        .find("#define KVH_STATUS_LIST(X)")
        .expect("KVH_STATUS_LIST");
    let mut out = Vec::new();
    for line in text[start..].lines().skip(1) {
        let line = line.trim();
        let Some(body) = line.strip_prefix("X(") else {
            break;
        };
        let body = &body[..body.rfind(')').unwrap()];
        let mut parts = body.splitn(3, ',');
        let name = parts.next().unwrap().trim().to_owned();
        let value: i32 = parts.next().unwrap().trim().parse().unwrap();
        let desc = parts.next().unwrap().trim().trim_matches('"').to_owned();
        out.push((name, value, desc));
        if !line.ends_with('\\') {
            break;
        }
    }
    out
}

#[test]
fn every_header_status_is_mapped() {
    let list = header_statuses();
    assert!(list.len() >= 16, "parsed {} entries", list.len());
    assert_eq!(
        list.len(),
        Status::ALL.len(),
        "Status and KVH_STATUS_LIST differ"
    );
    for (name, value, desc) in &list {
        let s = Status::from_raw(*value);
        assert!(!matches!(s, Status::Unknown(_)), "{name} is not mapped");
        assert_eq!(s.code(), *value);
        assert_eq!(s.name(), name);
        assert_eq!(s.description(), desc);
        assert_eq!(s.to_string(), *name);
        assert_eq!(s.raw(), kvh::sys::kvh_status(*value));
        assert_eq!(s.is_ok(), *value == 0);
        // An error built from it displays the name and the description.
        let e = Error::new(s, "detail");
        assert_eq!(e.to_string(), format!("{name}: {desc}: detail"));
    }
    // ALL is in header order, so the header's entries pair up with it.
    for (s, (name, _, _)) in Status::ALL.iter().zip(&list) {
        assert_eq!(s.name(), name);
    }
}

#[test]
fn unknown_codes_from_a_newer_library() {
    let s = Status::from_raw(-77);
    assert_eq!(s, Status::Unknown(-77));
    assert_eq!(s.code(), -77);
    assert_eq!(s.name(), "KVH_ERR_UNKNOWN");
    assert!(!s.description().is_empty());
    let e = Error::new(s, "from the future");
    assert!(e.to_string().contains("-77"));
}

#[test]
fn error_is_a_std_error() {
    fn open_bad() -> Result<Engine, Box<dyn std::error::Error + Send + Sync>> {
        Ok(Engine::open(Config::new().block_tokens(3))?)
    }
    let err = open_bad().unwrap_err();
    assert!(err.source().is_none());
    let kvh_err = err.downcast_ref::<Error>().expect("a kvh::Error");
    assert_eq!(kvh_err.status(), Status::InvalidArg);
    assert!(kvh_err.message().contains("block_tokens"), "{kvh_err}");
    assert!(err
        .to_string()
        .starts_with("KVH_ERR_INVALID_ARG: invalid argument: "));
}

#[test]
fn invalid_arg_from_open() {
    for (what, cfg) in [
        ("head_dim 0", Config::new().head_dim(0)),
        ("layers 0", Config::new().num_layers(0)),
        (
            "block_tokens not a power of two",
            Config::new().block_tokens(12),
        ),
        ("lru_k 9", Config::new().lru_k(9)),
        (
            "device budget below one block",
            Config::new().device_bytes(16),
        ),
    ] {
        let err = Engine::open(cfg.backend(Backend::Cpu).host_bytes(0)).unwrap_err();
        assert_eq!(err.status(), Status::InvalidArg, "{what}: {err}");
        assert!(!err.message().is_empty(), "{what}");
    }
}

#[test]
fn bad_handle_for_a_freed_block() {
    let e = common::engine(1, 1, 4, 4, 8, 0);
    let s = e.create_sequence(0).unwrap();
    s.append(&[1, 2]).unwrap(); // a partial block: freed with the sequence
    let b = s.blocks().unwrap()[0];
    assert!(e.block_info(b).is_ok());
    drop(s);
    let err = e.block_info(b).unwrap_err();
    assert_eq!(err.status(), Status::BadHandle);
    assert!(!err.message().is_empty());
    // A forged handle too.
    let forged = kvh::Block::from_raw(kvh::sys::kvh_block { id: 0xdead_beef });
    assert_eq!(
        e.block_info(forged).unwrap_err().status(),
        Status::BadHandle
    );
}

#[test]
fn nospace_leaves_the_sequence_unchanged() {
    let e = common::engine(1, 1, 4, 4, 2, 1); // 3 blocks in all
    let s = e.create_sequence(0).unwrap();
    s.append(&[1; 8]).unwrap();
    let err = s.append(&[2; 9]).unwrap_err();
    assert_eq!(err.status(), Status::NoSpace, "{err}");
    assert_eq!(s.len().unwrap(), 8);
    s.append(&[3; 4]).unwrap();
    assert_eq!(s.len().unwrap(), 12);
}

#[test]
fn nospace_when_an_acquire_cannot_fit() {
    let e = common::engine(1, 1, 4, 4, 2, 8);
    let s = e.create_sequence(0).unwrap();
    s.append(&[1; 16]).unwrap(); // 4 blocks, only 2 device slots
    let err = s.acquire(..).unwrap_err();
    assert_eq!(err.status(), Status::NoSpace, "{err}");
    let hold = s.acquire(0..8).unwrap();
    drop(hold);
}

#[test]
fn not_resident_and_range() {
    let e = common::engine(1, 1, 4, 4, 4, 8);
    let s = e.create_sequence(0).unwrap();
    s.append(&[1; 8]).unwrap();
    s.migrate(.., Tier::Host).unwrap().wait(None).unwrap();
    assert_eq!(
        e.block_table(&[&s]).unwrap_err().status(),
        Status::NotResident
    );
    assert_eq!(s.acquire(4..20).unwrap_err().status(), Status::Range);
    // A reversed range is refused before the library sees it.
    #[allow(clippy::reversed_empty_ranges)]
    let err = s.pin(6..2).unwrap_err();
    assert_eq!(err.status(), Status::Range);
}

#[test]
fn sequences_of_another_engine_are_refused() {
    let e1 = common::engine(1, 1, 4, 4, 4, 0);
    let e2 = common::engine(1, 1, 4, 4, 4, 0);
    let s = e2.create_sequence(0).unwrap();
    let err = e1.block_table(&[&s]).unwrap_err();
    // as the library reports another engine's handle
    assert_eq!(err.status(), Status::BadHandle);
}

#[test]
fn explicit_cuda_is_ok_or_unsupported() {
    match Engine::open(
        Config::new()
            .backend(Backend::Cuda)
            .dtype(DType::F32)
            .head_dim(8)
            .device_bytes(1 << 20)
            .host_bytes(1 << 20),
    ) {
        Ok(e) => assert_eq!(e.backend(), "cuda"),
        Err(err) => {
            assert_eq!(err.status(), Status::Unsupported, "{err}");
            assert!(!err.message().is_empty());
        }
    }
}

#[test]
fn timeout_or_done_on_a_zero_wait() {
    let e = common::engine(4, 4, 64, 16, 64, 64);
    let s = e.create_sequence(0).unwrap();
    s.append(&[1; 16 * 32]).unwrap();
    let fence = s.migrate(.., Tier::Host).unwrap();
    match fence.wait(Some(std::time::Duration::ZERO)) {
        Ok(()) => {}
        Err(err) => assert_eq!(err.status(), Status::Timeout, "{err}"),
    }
    fence.wait(None).unwrap();
}

#[test]
fn errors_are_per_thread() {
    // kvh_last_error is thread-local: a failure on one thread does not
    // leak its message into an error raised on another.
    let e = common::engine(1, 1, 4, 4, 4, 0);
    std::thread::scope(|scope| {
        let t = scope.spawn(|| {
            let s = e.create_sequence(0).unwrap();
            s.truncate(5).unwrap_err()
        });
        let err = e.prefix_hash(0, &[1]).unwrap_err();
        let other = t.join().unwrap();
        assert_eq!(err.status(), Status::InvalidArg);
        assert_eq!(other.status(), Status::Range);
        assert!(other.message().contains("truncate"), "{other}");
        assert!(!err.message().contains("truncate"), "{err}");
    });
}
