//! Builds or finds libkvh and links it. Nothing is generated here: the
//! bindings are committed (bindings/gen-rust.sh). Only `std` is used and
//! only `cmake` (and the C compiler it finds) is run, so the crate has no
//! registry dependencies, not even build-dependencies.
//!
//! **Feature `bundled` (default).** libkvh is built from its C sources with
//! CMake into `OUT_DIR` (Release, `KVH_BUILD_TESTS=OFF`,
//! `KVH_BUILD_BENCH=OFF`, `KVH_WITH_CUDA=OFF` unless `KVH_WITH_CUDA=ON`) and
//! `libkvh.a` is linked statically, with its system libraries: liburing
//! (statically when `liburing.a` lies beside the `liburing.so` CMake found,
//! as Debian's liburing-dev installs it), libnuma when the build found it,
//! pthread, dl and m. The program then needs no libkvh at run time and no
//! environment variable. The C sources are found at:
//! 1. `KVH_SOURCE_DIR`, when set;
//! 2. `vendor/kvh` inside this crate (where a packaged crate would carry
//!    them: publishing to crates.io needs the C sources copied there, as
//!    `cargo package` takes only the crate's own directory);
//! 3. the nearest ancestor directory of this crate holding the kvh C tree
//!    (`CMakeLists.txt` and `abi/include/kvh/kvh.h`): `../../` in the
//!    repository.
//!
//! `KVH_LIB_DIR` set to a directory holding `libkvh.so` takes precedence
//! over the bundled build and links that library instead (what `make
//! test-rust` does with the repository's `build/`).
//!
//! **Without `bundled`** (`default-features = false`), libkvh.so is found
//! through, in order:
//! 1. `KVH_LIB_DIR`: the directory holding libkvh.so;
//! 2. `pkg-config --libs kvh` (the kvh.pc that CMake installs);
//! 3. the repository's `build/` directory, if it holds libkvh.so.
//!
//! and linked dynamically. Each directory is written as an rpath of this
//! crate's binaries and passed on to dependent build scripts as
//! `DEP_KVH_LIB_DIR` (cargo does not pass `rustc-link-arg` on): the `kvh`
//! crate's build script writes it into its own tests and examples, and a
//! downstream binary crate adds it with one line in its build script (see
//! rust/README.md).

use std::env;
use std::fs;
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

/// Links libkvh.so from a directory found by KVH_LIB_DIR, pkg-config or
/// the repository's build/.
fn link_system(dirs: Option<Vec<PathBuf>>) {
    let dirs = dirs
        .or_else(from_pkg_config)
        .or_else(from_repo_build)
        .unwrap_or_else(|| {
            println!(
                "cargo:warning=libkvh not found: set KVH_LIB_DIR, install kvh.pc, or build the \
                 C library into build/ (cmake -S . -B build && cmake --build build), or enable \
                 the `bundled` feature"
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

fn is_kvh_tree(dir: &Path) -> bool {
    dir.join("CMakeLists.txt").is_file() && dir.join("abi/include/kvh/kvh.h").is_file()
}

/// The root of the kvh C sources (see the search order above).
fn source_dir() -> PathBuf {
    if let Some(dir) = env::var_os("KVH_SOURCE_DIR").filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        if !is_kvh_tree(&dir) {
            panic!(
                "KVH_SOURCE_DIR={} is not the kvh source tree (no CMakeLists.txt and \
                 abi/include/kvh/kvh.h there)",
                dir.display()
            );
        }
        return dir;
    }
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let manifest = manifest.canonicalize().unwrap_or(manifest);
    let vendored = manifest.join("vendor/kvh");
    if is_kvh_tree(&vendored) {
        return vendored;
    }
    if let Some(dir) = manifest.ancestors().skip(1).find(|d| is_kvh_tree(d)) {
        return dir.to_path_buf();
    }
    panic!(
        "the `bundled` feature needs the kvh C sources, and none were found: not in \
         KVH_SOURCE_DIR (unset), not in {} and not in any directory above {}. Set \
         KVH_SOURCE_DIR to a kvh checkout, or build without the feature \
         (default-features = false) against an installed libkvh.",
        vendored.display(),
        manifest.display()
    );
}

fn run(cmd: &mut Command, what: &str) {
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("{what}: cannot run {:?}: {e}", cmd.get_program()));
    if !status.success() {
        panic!("{what} failed ({status}): {cmd:?}");
    }
}

/// Value of a `NAME:TYPE=value` entry of a CMakeCache.txt.
fn cache_entry(cache: &str, name: &str) -> Option<String> {
    cache.lines().find_map(|line| {
        let (key, value) = line.split_once('=')?;
        let (key, _) = key.split_once(':')?;
        (key == name && !value.is_empty() && !value.ends_with("-NOTFOUND"))
            .then(|| value.to_string())
    })
}

fn build_bundled() {
    let src = source_dir();
    for part in ["CMakeLists.txt", "cmake", "abi", "core", "kernels"] {
        println!("cargo:rerun-if-changed={}", src.join(part).display());
    }
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let build = out.join("build");
    let cmake = env::var_os("CMAKE").unwrap_or_else(|| "cmake".into());
    let cuda = env::var("KVH_WITH_CUDA")
        .map(|v| matches!(v.to_ascii_uppercase().as_str(), "1" | "ON" | "YES" | "TRUE"))
        .unwrap_or(false);
    run(
        Command::new(&cmake)
            .arg("-S")
            .arg(&src)
            .arg("-B")
            .arg(&build)
            .args([
                "-DCMAKE_BUILD_TYPE=Release",
                "-DKVH_BUILD_TESTS=OFF",
                "-DKVH_BUILD_BENCH=OFF",
                "-DKVH_STRESS=OFF",
                "-DKVH_FUZZ=OFF",
            ])
            .arg(format!(
                "-DKVH_WITH_CUDA={}",
                if cuda { "ON" } else { "OFF" }
            )),
        "cmake configure of libkvh",
    );
    let jobs = env::var("NUM_JOBS").unwrap_or_else(|_| "2".into());
    let mut targets = vec!["kvh_static"];
    if cuda {
        targets.push("kvh_cuda");
    }
    for target in targets {
        run(
            Command::new(&cmake).arg("--build").arg(&build).args([
                "--target",
                target,
                "--parallel",
                &jobs,
            ]),
            "cmake build of libkvh",
        );
    }

    let cache = fs::read_to_string(build.join("CMakeCache.txt")).unwrap_or_default();
    println!("cargo:rustc-link-search=native={}", build.display());
    println!("cargo:rustc-link-lib=static=kvh");

    // liburing: the archive beside the shared object CMake found, copied
    // into OUT_DIR so that no system directory joins the link search path.
    let uring = cache_entry(&cache, "KVH_URING_LIB").map(PathBuf::from);
    let uring_a = uring
        .as_ref()
        .map(|so| so.with_file_name("liburing.a"))
        .filter(|a| a.is_file());
    match uring_a {
        Some(archive) => {
            let deps = out.join("deps");
            fs::create_dir_all(&deps).expect("create OUT_DIR/deps");
            fs::copy(&archive, deps.join("liburing.a")).expect("copy liburing.a");
            println!("cargo:rustc-link-search=native={}", deps.display());
            println!("cargo:rustc-link-lib=static=uring");
        }
        None => {
            if let Some(dir) = uring.as_ref().and_then(|so| so.parent()) {
                println!("cargo:rustc-link-search=native={}", dir.display());
            }
            println!("cargo:rustc-link-lib=dylib=uring");
        }
    }
    if cache_entry(&cache, "KVH_NUMA_LIB").is_some()
        && cache_entry(&cache, "KVH_NUMA_INCLUDE").is_some()
    {
        println!("cargo:rustc-link-lib=dylib=numa");
    }
    for lib in ["pthread", "dl", "m"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    if cuda {
        let backend = build.join("libkvh_cuda.so");
        println!(
            "cargo:warning=CUDA backend built at {}: copy it beside the program or point \
             KVH_CUDA_BACKEND at it",
            backend.display()
        );
        println!("cargo:cuda_backend={}", backend.display());
    }
    println!("cargo:lib_dir=");
    println!("cargo:include={}", src.join("abi/include").display());
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for var in [
        "KVH_LIB_DIR",
        "KVH_SOURCE_DIR",
        "KVH_WITH_CUDA",
        "CMAKE",
        "CC",
        "CFLAGS",
        "PKG_CONFIG",
        "PKG_CONFIG_PATH",
        "PKG_CONFIG_LIBDIR",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let explicit = from_env();
    if env::var_os("CARGO_FEATURE_BUNDLED").is_some() && explicit.is_none() {
        build_bundled();
    } else {
        link_system(explicit);
    }
}
