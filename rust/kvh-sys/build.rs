//! Finds libkvh and links it (dynamically). Nothing is generated here: the
//! bindings are committed (bindings/gen-rust.sh).
//!
//! Search order:
//! 1. `KVH_LIB_DIR`: the directory holding libkvh.so;
//! 2. `pkg-config --libs kvh` (the kvh.pc that CMake installs);
//! 3. the repository's `build/` directory, if it holds libkvh.so.
//!
//! Each directory found is also written as an rpath, so test binaries and
//! examples run without LD_LIBRARY_PATH, and is passed on to dependent build
//! scripts as `DEP_KVH_LIB_DIR` (rustc-link-arg does not propagate).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn from_env() -> Option<Vec<PathBuf>> {
    let dir = env::var_os("KVH_LIB_DIR").filter(|d| !d.is_empty())?;
    let dir = PathBuf::from(dir);
    if !dir.join("libkvh.so").exists() && !dir.join("libkvh.a").exists() {
        println!(
            "cargo:warning=KVH_LIB_DIR={} holds no libkvh",
            dir.display()
        );
    }
    Some(vec![dir])
}

fn from_pkg_config() -> Option<Vec<PathBuf>> {
    let pkg_config = env::var_os("PKG_CONFIG").unwrap_or_else(|| "pkg-config".into());
    let out = Command::new(pkg_config)
        .args(["--libs", "kvh"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let libs = String::from_utf8(out.stdout).ok()?;
    Some(
        libs.split_whitespace()
            .filter_map(|flag| flag.strip_prefix("-L"))
            .map(PathBuf::from)
            .collect(),
    )
}

fn from_repo_build() -> Option<Vec<PathBuf>> {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR")?);
    let dir = manifest.join("../../build");
    dir.join("libkvh.so")
        .exists()
        .then(|| vec![dir.canonicalize().unwrap_or(dir)])
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for var in [
        "KVH_LIB_DIR",
        "PKG_CONFIG",
        "PKG_CONFIG_PATH",
        "PKG_CONFIG_LIBDIR",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let dirs = from_env()
        .or_else(from_pkg_config)
        .or_else(from_repo_build)
        .unwrap_or_else(|| {
            println!(
                "cargo:warning=libkvh not found: set KVH_LIB_DIR, install kvh.pc, or build the \
                 C library into build/ (cmake -S . -B build && cmake --build build)"
            );
            Vec::new()
        });
    for dir in &dirs {
        let dir: &Path = dir;
        println!("cargo:rustc-link-search=native={}", dir.display());
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
    }
    println!("cargo:rustc-link-lib=dylib=kvh");
    let joined: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    println!("cargo:lib_dir={}", joined.join(":"));
}
