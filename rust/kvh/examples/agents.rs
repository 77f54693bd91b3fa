//! Agents sharing a system prompt: `cargo run --example agents`.
//!
//! 1. opens an engine with a small device tier, a host tier and, when this
//!    build has one, a disk tier;
//! 2. a "planner" agent computes the KV of a system prompt, pins it, and
//!    three more agents attach it through the prefix index;
//! 3. one agent forks (copy-on-write) to try an alternative continuation;
//! 4. long contexts overflow the device tier and spill to host; the disk
//!    tier (if any) receives a persisted copy;
//! 5. a helper thread issues prefetch hints while the main thread reads;
//! 6. statistics and tier occupancy are printed.

use std::time::{Duration, Instant};

use kvh::{Backend, Config, DType, Engine, Sequence, Tier};

const LAYERS: u32 = 4;
const KV_HEADS: u32 = 2;
const HEAD_DIM: u32 = 32;
const BLOCK_TOKENS: u32 = 16;

/// Stand-in for a model: deterministic K/V per (layer, token id, position).
fn compute_kv(engine: &Engine, seq: &Sequence<'_>, from: u64) -> kvh::Result<()> {
    let g = *engine.geometry();
    let len = seq.len()?;
    let n = (len - from) as usize;
    let mut ids = vec![0; n];
    seq.tokens_into(from, &mut ids)?;
    for layer in 0..g.num_layers {
        let mut k = Vec::with_capacity(n * g.token_elems());
        for (i, id) in ids.iter().enumerate() {
            let pos = from as usize + i;
            for e in 0..g.token_elems() {
                k.push(
                    ((*id as f32) * 0.01 + pos as f32 * 0.001 + e as f32 * 1e-5 + layer as f32)
                        .sin(),
                );
            }
        }
        let v: Vec<f32> = k.iter().map(|x| x * 0.5).collect();
        seq.write_kv(layer, from, &k, &v)?;
    }
    Ok(())
}

fn config(block_bytes: u64) -> Config {
    Config::new()
        .backend(Backend::Auto)
        .dtype(DType::F32)
        .num_layers(LAYERS)
        .num_kv_heads(KV_HEADS)
        .head_dim(HEAD_DIM)
        .block_tokens(BLOCK_TOKENS)
        .model_salt(0xa9e7)
        // A deliberately small device tier, so contexts spill.
        .device_bytes(24 * block_bytes)
        .host_bytes(512 * block_bytes)
}

fn print_tiers(engine: &Engine) -> kvh::Result<()> {
    for tier in Tier::ALL {
        let t = engine.tier_info(tier)?;
        if t.present() {
            println!(
                "    {:<6} {:>4}/{:<4} blocks used ({:>5.1} MiB), {} pinned",
                tier.name(),
                t.used_blocks,
                t.capacity_blocks,
                t.used_bytes as f64 / (1 << 20) as f64,
                t.pinned_blocks
            );
        } else {
            println!("    {:<6} absent", tier.name());
        }
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("kvh {} (Rust front-end)", kvh::version_string());
    let block_bytes = 2 * u64::from(LAYERS * KV_HEADS * BLOCK_TOKENS * HEAD_DIM) * 4;

    // 1. Engine, with a disk tier where this build provides one.
    let disk_dir = std::env::temp_dir().join(format!("kvh-agents-{}", std::process::id()));
    let opened = std::fs::create_dir_all(&disk_dir)
        .map_err(|e| kvh::Error::new(kvh::Status::Io, format!("{}: {e}", disk_dir.display())))
        .and_then(|()| {
            Engine::open(
                config(block_bytes)
                    .disk(&disk_dir, 1024 * block_bytes)
                    .disk_reset_on_mismatch(true),
            )
        });
    let (engine, disk) = match opened {
        Ok(engine) => (engine, true),
        // Unsupported in a build without the disk tier; anything else (a
        // read-only temp dir, ...) falls back the same way.
        Err(err) => {
            println!("disk tier unavailable ({err}): spilling to host only");
            (Engine::open(config(block_bytes))?, false)
        }
    };
    println!(
        "engine: backend {}, {} layers x {} kv heads x {} dims, {} tokens/block = {} KiB/block",
        engine.backend(),
        LAYERS,
        KV_HEADS,
        HEAD_DIM,
        BLOCK_TOKENS,
        engine.block_bytes() / 1024
    );

    // 2. The planner computes the system prompt once and pins it.
    let system: Vec<i32> = (0..72).map(|i| 1000 + i).collect(); // 4.5 blocks
    let planner = engine.create_sequence(0)?;
    planner.append(&system)?;
    compute_kv(&engine, &planner, 0)?;
    let full = system.len() / BLOCK_TOKENS as usize * BLOCK_TOKENS as usize;
    planner.pin(0..full as u64)?;
    println!(
        "\nplanner: system prompt of {} tokens, {} pinned in the device tier",
        system.len(),
        full
    );

    let names = ["researcher", "coder", "critic"];
    let mut agents = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let agent = i as u32 + 1;
        let seq = engine.create_sequence(agent)?;
        let matched = seq.match_prefix(&system)?;
        // Compute only what the cache did not have.
        seq.append(&system[matched..])?;
        compute_kv(&engine, &seq, matched as u64)?;
        let task: Vec<i32> = (0..40 + 30 * i as i32)
            .map(|t| 5000 * agent as i32 + t)
            .collect();
        let before = seq.len()?;
        seq.append(&task)?;
        compute_kv(&engine, &seq, before)?;
        println!(
            "{name:>10}: reused {matched:>3} of {} prompt tokens, {} tokens in all",
            system.len(),
            seq.len()?
        );
        agents.push(seq);
    }
    let shared = engine.block_info(planner.blocks()?[0])?;
    println!(
        "  first system-prompt block: {} references, published {}",
        shared.refs, shared.published
    );

    // 3. The coder forks to try an alternative last token.
    let coder = &agents[1];
    let alt = coder.fork(9)?;
    let len = alt.len()?;
    alt.truncate(len - 1)?;
    alt.append(&[-1])?;
    compute_kv(&engine, &alt, len - 1)?;
    let (cb, ab) = (coder.blocks()?, alt.blocks()?);
    let same = cb.iter().zip(&ab).filter(|(a, b)| a == b).count();
    println!(
        "\nfork: alternative shares {same} of {} blocks with the coder; {} copy-on-write copies so far",
        ab.len(),
        engine.stats()?.cow_copies
    );

    // 4. Long contexts: more than the device tier holds.
    let long = engine.create_sequence(4)?;
    for chunk in 0..8 {
        let toks: Vec<i32> = (0..64).map(|t| 90_000 + chunk * 64 + t).collect();
        let before = long.len()?;
        long.append(&toks)?;
        compute_kv(&engine, &long, before)?;
    }
    long.migrate(..256, Tier::Host)?
        .wait(Some(Duration::from_secs(10)))?;
    println!(
        "\nspill: a {}-token context, its first half moved to host",
        long.len()?
    );
    if disk {
        let t = Instant::now();
        match long.persist() {
            Ok(()) => println!(
                "  persisted its full blocks to {} in {:?}",
                disk_dir.display(),
                t.elapsed()
            ),
            Err(err) => println!("  persist failed ({err}): the blocks stay in host"),
        }
        match long.migrate(..128, Tier::Disk) {
            Ok(f) => match f.wait(Some(Duration::from_secs(30))) {
                Ok(()) => println!("  moved 128 tokens down to the disk tier"),
                Err(err) => println!("  disk migration failed: {err}"),
            },
            Err(err) => println!("  disk migration unavailable: {err}"),
        }
    } else {
        match long.persist() {
            Ok(()) => println!("  persisted (unexpectedly, without a disk tier)"),
            Err(err) => println!(
                "  persist: {} (no disk tier), blocks spilled to host instead",
                err.status()
            ),
        }
    }
    print_tiers(&engine)?;

    // 5. A helper thread hints what the researcher needs next while the
    //    main thread reads the coder's context.
    let researcher = &agents[0];
    let hint_view = researcher.shared();
    let rlen = hint_view.len()?;
    let read = std::thread::scope(|scope| -> kvh::Result<usize> {
        let helper = scope.spawn(move || -> kvh::Result<()> {
            let fence = hint_view.prefetch_with_fence(0..rlen, 10)?;
            fence.wait(Some(Duration::from_secs(10)))
        });
        let mut floats = 0;
        for layer in 0..LAYERS {
            let (k, v) = coder.read_kv_vec::<f32>(layer, 0, coder.len()? as usize)?;
            floats += k.len() + v.len();
        }
        helper.join().expect("helper thread")?;
        Ok(floats)
    })?;
    println!(
        "\nprefetch: researcher's {rlen} tokens hinted while {read} floats of the coder were read"
    );

    // The researcher decodes: hold its context in the device tier and build
    // the batch's block table.
    {
        let hold = researcher.acquire(..)?;
        let table = engine.block_table(&[researcher])?;
        println!(
            "  researcher holds tokens {:?} in the device tier: {} slots, last block {} tokens",
            hold.range(),
            table.indices.len(),
            table.last_page_len[0]
        );
    }

    // 6. Statistics.
    let s = engine.stats()?;
    println!("\nstats:");
    println!(
        "    lookups {} (device {}, host {}, disk {}), device hit rate {:.0}%",
        s.lookups,
        s.hits_device,
        s.hits_host,
        s.hits_disk,
        100.0 * s.device_hit_rate()
    );
    println!(
        "    prefix: {} queries, {} blocks / {} tokens reused",
        s.prefix_queries, s.prefix_hit_blocks, s.prefix_hit_tokens
    );
    println!(
        "    moved: {} blocks device->host, {} host->device, {} host->disk, {} disk->host",
        s.blocks_device_to_host,
        s.blocks_host_to_device,
        s.blocks_host_to_disk,
        s.blocks_disk_to_host
    );
    println!(
        "    prefetch: {} issued, {} useful, {} late, {} wasted; {} CoW copies, {} evictions",
        s.prefetch_issued,
        s.prefetch_useful,
        s.prefetch_late,
        s.prefetch_wasted,
        s.cow_copies,
        s.evictions
    );
    print_tiers(&engine)?;

    planner.unpin(0..full as u64)?;
    drop((alt, long, agents, planner));
    drop(engine);
    let _ = std::fs::remove_dir_all(&disk_dir);
    Ok(())
}
