//! Config::apply_vars / apply_env: kvh_config_from_env from Rust.

use kvh::{Backend, Config, DType, Engine, Status, Tier};

#[test]
fn vars_set_fields_over_the_builder() {
    let config = Config::new()
        .head_dim(32)
        .num_layers(2)
        .apply_vars([
            ("KVH_NUM_LAYERS", "3"),
            ("KVH_DTYPE", "f32"),
            ("KVH_BACKEND", "cpu"),
            ("KVH_DEVICE_BYTES", "256K"),
            ("KVH_HOST_BYTES", "1M"),
            ("KVH_DISK_PATH", "/tmp/kvh-rust-env"),
            ("KVH_OTHER", "ignored"),
        ])
        .expect("valid variables");
    let g = config.geometry();
    assert_eq!(g.num_layers, 3);
    assert_eq!(g.head_dim, 32);
    assert_eq!(g.dtype, DType::F32);
    assert_eq!(config.as_raw().host_bytes, 1 << 20);
    assert_eq!(config.as_raw().backend, Backend::Cpu as u32);
    assert!(config.as_raw().disk_path.is_null());
    assert_eq!(
        config.disk_path().as_deref(),
        Some(std::path::Path::new("/tmp/kvh-rust-env"))
    );
}

#[test]
fn bad_value_names_the_variable() {
    let err = Config::new()
        .apply_vars([("KVH_HOST_BYTES", "4X")])
        .expect_err("4X is no size");
    assert_eq!(err.status(), Status::InvalidArg);
    assert!(
        err.message().contains("KVH_HOST_BYTES=\"4X\""),
        "{}",
        err.message()
    );
}

#[test]
fn process_environment_opens_an_engine() {
    // The only test of this binary that touches the process environment.
    std::env::set_var("KVH_HEAD_DIM", "16");
    std::env::set_var("KVH_HOST_BYTES", "512K");
    let config = Config::new()
        .backend(Backend::Cpu)
        .device_bytes(256 << 10)
        .apply_env();
    std::env::remove_var("KVH_HEAD_DIM");
    std::env::remove_var("KVH_HOST_BYTES");
    let config = config.expect("valid environment");
    assert_eq!(config.geometry().head_dim, 16);
    let engine = Engine::open(config).expect("open");
    let host = engine.tier_info(Tier::Host).expect("host tier");
    assert!(host.capacity_blocks > 0);
    assert!(host.capacity_blocks * engine.block_bytes() <= 512 << 10);
}

#[test]
fn remote_upload_names_match_the_environment() {
    use kvh::remote_upload;
    let config = Config::new()
        .apply_vars([("KVH_REMOTE_UPLOAD", "persist,write_through")])
        .expect("valid upload names");
    assert_eq!(
        config.as_raw().remote_upload,
        remote_upload::PERSIST | remote_upload::WRITE_THROUGH
    );
    let config = Config::new().remote_upload(remote_upload::DEMOTE);
    assert_eq!(config.as_raw().remote_upload, 2);
}

#[test]
fn prefault_memory_opens_with_backed_tiers() {
    let config = Config::new()
        .backend(Backend::Cpu)
        .device_bytes(256 << 10)
        .host_bytes(1 << 20)
        .prefault_memory(true);
    assert_eq!(config.as_raw().prefault_memory, 1);
    let from_env = Config::new()
        .apply_vars([("KVH_PREFAULT_MEMORY", "1")])
        .expect("valid variable");
    assert_eq!(from_env.as_raw().prefault_memory, 1);
    let engine = Engine::open(config).expect("open");
    assert!(
        engine
            .tier_info(Tier::Host)
            .expect("host tier")
            .capacity_blocks
            > 0
    );
}
