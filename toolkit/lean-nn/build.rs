//! With the `cuda` feature, compiles `kernels/*.cu` to PTX (nvcc, for the
//! compute capability in `CUDA_COMPUTE_CAP`, as candle's own kernels are),
//! with candle-kernel-params' shared header
//! (`DEP_CANDLE_KERNEL_PARAMS_INCLUDE`).

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=kernels");
    #[cfg(feature = "cuda")]
    {
        let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
        let include = std::path::PathBuf::from(
            std::env::var("DEP_CANDLE_KERNEL_PARAMS_INCLUDE")
                .expect("candle-kernel-params' build script sets it"),
        );
        cudaforge::KernelBuilder::new()
            .source_dir("kernels")
            .include_path(&include)
            // The headers: a kernel is compiled anew when one changes.
            .watch(["kernels".into(), include.clone()])
            .arg("-O3")
            .build_ptx()
            .unwrap_or_else(|e| panic!("compiling kernels/*.cu with nvcc: {e:?}"))
            .write(out.join("ptx.rs"))
            .unwrap_or_else(|e| panic!("writing the PTX's Rust module: {e:?}"));
    }
}
