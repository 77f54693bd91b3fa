//! Adds the rpath of the libkvh that kvh-sys linked (`DEP_KVH_LIB_DIR`) to
//! this crate's tests, examples and binaries: cargo does not pass a
//! dependency's `rustc-link-arg` on.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_KVH_LIB_DIR");
    if let Ok(dirs) = std::env::var("DEP_KVH_LIB_DIR") {
        for dir in dirs.split(':').filter(|d| !d.is_empty()) {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        }
    }
}
