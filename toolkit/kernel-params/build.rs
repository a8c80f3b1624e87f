//! Tells the build scripts of the crates that depend on this one where the
//! shared kernel header is: `DEP_CANDLE_KERNEL_PARAMS_INCLUDE`, the folder
//! to pass to nvcc as `-I` for `#include "candle_kernel_params/elements.cuh"`.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    let dir = std::path::Path::new(&std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"))
        .join("include");
    println!("cargo::metadata=include={}", dir.display());
}
