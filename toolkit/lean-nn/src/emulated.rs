//! The crate's CUDA kernels (`kernels/*.cu`) run on the CPU by the harnesses
//! in `tests/emulated/` (a C++ compiler builds them with just enough of
//! CUDA emulated: `candle-toolkit-cuda-emulation`), against what the CPU
//! computes.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use candle_core::{DType, Tensor};
use candle_toolkit_cuda_emulation::Build;

mod activation;
mod cross_entropy;

/// The harness `tests/emulated/<name>.cpp`, built once per process and
/// build.
fn harness(name: &str, build: Build) -> PathBuf {
    static BUILT: Mutex<Vec<((String, Build), PathBuf)>> = Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    let key = (name.to_string(), build);
    if let Some((_, exe)) = built.iter().find(|(k, _)| *k == key) {
        return exe.clone();
    }
    let source = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/emulated")
        .join(format!("{name}.cpp"));
    let exe = candle_toolkit_cuda_emulation::compile_as(&source, build);
    built.push((key, exe.clone()));
    exe
}

/// A tensor's elements as f64s (exact for every float dtype).
fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.to_vec1())
        .expect("a tensor's values")
}

/// The bits of each value.
fn bits(v: &[f64]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits()).collect()
}
