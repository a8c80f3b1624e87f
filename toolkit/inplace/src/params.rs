//! The parameters of candle's kernels as `launch.rs` passes them. An
//! operand that is also the output travels as an address ([`Ptr`] beside
//! [`PtrMut`]), and so does a null pointer: the test holds each struct to
//! the declaration of every kernel it launches, in the sources of the
//! candle-kernels that candle-core builds.

use candle_kernel_params::{kernel_params, In, Ptr, PtrMut, Val};

/// The kernels `launch.rs` calls, by candle's names before the element
/// type's suffix (`badd_f32`).
pub(crate) mod name {
    /// [`BinaryAssign`](super::BinaryAssign)'s: `out + rhs`, `out - rhs`,
    /// `out * rhs`.
    pub(crate) const ADD: &str = "badd";
    pub(crate) const SUB: &str = "bsub";
    pub(crate) const MUL: &str = "bmul";
    /// [`UnaryInPlace`](super::UnaryInPlace)'s: ReLU.
    pub(crate) const RELU: &str = "urelu";
    /// [`AffineInPlace`](super::AffineInPlace)'s.
    pub(crate) const AFFINE: &str = "affine";
    /// [`SoftmaxInPlace`](super::SoftmaxInPlace)'s.
    pub(crate) const SOFTMAX: &str = "softmax";
}

kernel_params! {
    /// `b<op>_<T>(numel, num_dims, dims_and_strides, lhs, rhs, out)`
    /// (`binary_op_macros.cuh`), with the output as its left operand.
    pub(crate) struct BinaryAssign<T> {
        numel: usize,
        num_dims: usize,
        /// The output's dims and strides, then `rhs`'s strides; null where
        /// `rhs` is contiguous.
        dims_and_strides: Ptr<usize>,
        lhs: Ptr<T>,
        rhs: In<T>,
        out: PtrMut<T>,
    }
}

kernel_params! {
    /// `u<op>_<T>(numel, num_dims, info, inp, out)` (`unary.cu`) in its
    /// in-place mode: `info` and `inp` null, each element read from `out`.
    /// Not every unary kernel's mode holds: the vectorised bf16 `usilu`,
    /// `usigmoid` and `ucopy` load through `inp` even when it is null.
    pub(crate) struct UnaryInPlace<T> {
        numel: usize,
        num_dims: usize,
        info: Ptr<usize>,
        inp: Ptr<T>,
        out: PtrMut<T>,
    }
}

kernel_params! {
    /// `affine_<T>(numel, num_dims, info, inp, out, mul, add)`
    /// (`affine.cu`) in its in-place mode, as [`UnaryInPlace`].
    pub(crate) struct AffineInPlace<T> {
        numel: usize,
        num_dims: usize,
        info: Ptr<usize>,
        inp: Ptr<T>,
        out: PtrMut<T>,
        mul: Val<T>,
        add: Val<T>,
    }
}

kernel_params! {
    /// `softmax_<T>(src, dst, n_cols)` (`reduce.cu`) with `dst` its `src`.
    pub(crate) struct SoftmaxInPlace<T> {
        src: Ptr<T>,
        dst: PtrMut<T>,
        n_cols: i32,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::path::{Path, PathBuf};
    use std::process::Command;

    use candle_kernel_params::Params;

    use super::*;

    /// The `src` folder of the candle-kernels that this crate's candle-core
    /// builds with its `cuda` feature (cargo fetches it if it is not here
    /// yet): the kernels these launches call.
    pub(crate) fn candle_kernels_src() -> PathBuf {
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
        let out = Command::new(env!("CARGO"))
            // --locked: the versions Cargo.lock holds, which a build uses.
            .args([
                "metadata",
                "--locked",
                "--format-version",
                "1",
                "--features",
                "cuda",
            ])
            .arg("--manifest-path")
            .arg(&manifest)
            .output()
            .expect("running cargo metadata");
        assert!(
            out.status.success(),
            "cargo metadata: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let metadata: serde_json::Value =
            serde_json::from_slice(&out.stdout).expect("cargo metadata's JSON");
        let kernels: Vec<&serde_json::Value> = metadata["packages"]
            .as_array()
            .expect("packages")
            .iter()
            .filter(|p| p["name"] == "candle-kernels")
            .collect();
        let [kernels] = kernels[..] else {
            panic!("{} candle-kernels in the build, not one", kernels.len());
        };
        let manifest = kernels["manifest_path"].as_str().expect("a manifest path");
        Path::new(manifest)
            .parent()
            .expect("the manifest's folder")
            .join("src")
    }

    #[test]
    fn every_candle_kernel_launched_takes_what_its_launch_passes() {
        let src = candle_kernels_src();
        let files = ["binary.cu", "unary.cu", "affine.cu", "reduce.cu"].map(|f| src.join(f));
        // As nvcc compiles them for sm_90, with their half-type kernels.
        let declared = candle_toolkit_cuda_emulation::declarations_for_arch(
            &files.each_ref().map(PathBuf::as_path),
            900,
        );
        for (suffix, launches) in [
            ("f32", launched::<f32>()),
            ("f64", launched::<f64>()),
            ("f16", launched::<half::f16>()),
            ("bf16", launched::<half::bf16>()),
        ] {
            for (kernel, params) in launches {
                let name = format!("{kernel}_{suffix}");
                let Some(c) = declared.get(&name) else {
                    panic!("candle-kernels has no kernel {name}");
                };
                assert_eq!(
                    &params, c,
                    "{name}: what the launch passes, then the declaration"
                );
            }
        }
    }

    /// Each kernel `launch.rs` launches for the element type `T`, with the
    /// parameters it passes.
    fn launched<T: candle_kernel_params::Elem>() -> Vec<(&'static str, Vec<String>)> {
        let binary = BinaryAssign::<T>::c_params;
        vec![
            (name::ADD, binary()),
            (name::SUB, binary()),
            (name::MUL, binary()),
            (name::RELU, UnaryInPlace::<T>::c_params()),
            (name::AFFINE, AffineInPlace::<T>::c_params()),
            (name::SOFTMAX, SoftmaxInPlace::<T>::c_params()),
        ]
    }
}
