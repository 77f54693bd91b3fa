//! Shared helpers of the integration tests.
#![allow(dead_code)]

use std::process::Command;
use std::time::{Duration, Instant};

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

/// A disk store under the temp directory (named for this process and
/// `name`) holding one persisted sequence of `tokens` whose blocks fail
/// their checksum when read back, so that moving them logs a warning on
/// the migration worker: its directory (the caller removes it) and the
/// configuration that opens it (one worker, f32, 8-dim heads of 4-token
/// blocks).
pub fn store_failing_checksums(
    name: &str,
    tokens: &[i32],
) -> (std::path::PathBuf, impl Fn() -> Config) {
    let dir = std::env::temp_dir().join(format!("kvh-rust-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let slab = dir.join("slab-0000.kvh");
    let store = dir.clone();
    let config = move || {
        Config::new()
            .backend(Backend::Cpu)
            .dtype(DType::F32)
            .head_dim(8)
            .block_tokens(4)
            .device_bytes(4 * 256)
            .host_bytes(4 * 256)
            .disk(&store, 16 * 8192)
            .migration_threads(1)
    };
    {
        let e = Engine::open(config()).unwrap();
        let s = e.create_sequence(0).unwrap();
        s.append(tokens).unwrap();
        fill(&e, &s, 1);
        s.persist().unwrap();
    }
    let mut bytes = std::fs::read(&slab).unwrap();
    for off in (4096 + 100..bytes.len()).step_by(8192) {
        bytes[off] ^= 0x08;
    }
    std::fs::write(&slab, bytes).unwrap();
    (dir, config)
}

/// One layer of one 64-dim f32 head in 16-token blocks on the CPU, views
/// on (one head's K of a block is a whole 4 KiB page); budgets, threads
/// and the rest are the caller's.
pub fn one_head_view_config() -> Config {
    Config::new()
        .backend(Backend::Cpu)
        .vmap(true)
        .num_layers(1)
        .num_kv_heads(1)
        .head_dim(64)
        .block_tokens(16)
        .dtype(DType::F32)
}

/// A CPU engine whose views work: one head's K of a block is a whole page.
pub fn vmap_engine() -> Engine {
    Engine::open(
        Config::new()
            .backend(Backend::Cpu)
            .dtype(DType::F32)
            .num_layers(1)
            .num_kv_heads(2)
            .head_dim(64)
            .block_tokens(16)
            .device_bytes(8 << 20)
            .host_bytes(8 << 20)
            .vmap(true),
    )
    .expect("open vmap engine")
}

/// Runs the child case `name` (the test binary again, selected by the
/// environment variable `var`) with a deadline, under `ulimit -v vmem_kib` when
/// given; returns (exit code, or None for a signal or a timeout, and the
/// combined output).
pub fn run_child(
    var: &str,
    name: &str,
    deadline: Duration,
    vmem_kib: Option<u64>,
) -> (Option<i32>, String) {
    let exe = std::env::current_exe().expect("test binary");
    let args = ["child_entry", "--exact", "--nocapture", "--test-threads=1"];
    let mut cmd = match vmem_kib {
        None => {
            let mut c = Command::new(&exe);
            c.args(args);
            c
        }
        Some(kib) => {
            let mut c = Command::new("/bin/sh");
            c.arg("-c")
                .arg(format!("ulimit -v {kib} && exec \"$0\" \"$@\""))
                .arg(&exe)
                .args(args);
            c
        }
    };
    let mut child = cmd
        .env(var, name)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn child");
    let start = Instant::now();
    loop {
        if child.try_wait().expect("wait child").is_some() {
            break;
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("child output");
            return (
                None,
                format!(
                    "child {name} hung (killed after {deadline:?})\n{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().expect("child output");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

pub fn child_passes(var: &str, name: &str, vmem_kib: Option<u64>) {
    let (code, text) = run_child(var, name, Duration::from_secs(20), vmem_kib);
    assert_eq!(code, Some(0), "child case {name} failed:\n{text}");
    assert!(
        text.contains("1 passed"),
        "child case {name} did not run:\n{text}"
    );
}

/// A 2-layer, 2-head, 8-dim CPU engine of 4-token blocks with room for
/// 64 device and 256 host blocks.
pub fn small() -> Engine {
    engine(2, 2, 8, 4, 64, 256)
}

/// In the child process (the variable `var` names a case): runs that case
/// of `cases`; in a normal run, nothing.
pub fn run_child_case(var: &str, cases: &[(&str, fn())]) {
    let Ok(name) = std::env::var(var) else {
        return;
    };
    let case = cases
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no child case {name}"));
    (case.1)();
}

/// A CPU engine for weight contexts: f32, head_dim 8, 4-token blocks,
/// 256 KiB of device and 1 MiB of host memory.
pub fn context_engine() -> Engine {
    Engine::open(
        Config::new()
            .backend(Backend::Cpu)
            .dtype(DType::F32)
            .head_dim(8)
            .block_tokens(4)
            .device_bytes(256 << 10)
            .host_bytes(1 << 20),
    )
    .expect("open context engine")
}
