//! AdamW's CUDA kernels (`kernels/adamw.cu`), run on the CPU by
//! `tests/emulated/adamw.cpp` (a C++ compiler builds them with just enough
//! of CUDA emulated: `candle-toolkit-cuda-emulation`), with the constants
//! the GPU's launches pass, against the CPU kernel's bits: both round each
//! operation on its own, in the same order.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::ParamsAdamW;

use crate::kernel::{AdamWStep, Moment1, Moment2, Theta};

fn harness() -> &'static Path {
    static HARNESS: OnceLock<PathBuf> = OnceLock::new();
    HARNESS.get_or_init(|| {
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/emulated/adamw.cpp");
        candle_toolkit_cuda_emulation::compile(&source)
    })
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().to_vec1().unwrap()
}

/// The kernel `adamw_<kernel>_<dtype>` on `tensors` (the one it updates
/// first), over a grid of 3 blocks of 64 threads (fewer threads than
/// elements: the kernels' grid-stride loop covers the rest).
fn emulate(kernel: &str, constants: &[f64], tensors: &[&Tensor]) -> Vec<f64> {
    let name = format!("adamw_{kernel}_{}", tensors[0].dtype().as_str());
    let mut input = [0f64; 5].to_vec();
    input[..constants.len()].copy_from_slice(constants);
    input.extend(tensors.iter().flat_map(|t| values(t)));
    let n = tensors[0].elem_count().to_string();
    candle_toolkit_cuda_emulation::run_on_f64(harness(), &[&name, "3", "64", &n], &input)
}

fn bits(v: &[f64]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn the_kernels_update_with_the_cpu_kernels_bits_in_every_dtype() -> Result<()> {
    let params = ParamsAdamW {
        lr: 0.01,
        weight_decay: 0.1,
        ..Default::default()
    };
    // Step 3: bias corrections other than 1.
    let step = AdamWStep::new(&params, 3)?;
    let n = 1000;
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let r = |std: f32| -> Result<Tensor> {
            Tensor::randn(0f32, std, n, &Device::Cpu)?.to_dtype(dtype)
        };
        let (theta, m, g) = (r(1.0)?, r(0.1)?, r(1.0)?);
        let v = r(0.01)?.abs()?;

        let (a, b) = step.moment1_coefficients();
        let got = emulate("moment1", &[a, b], &[&m, &g]);
        let want = m.copy()?;
        want.inplace_op2(&g, &Moment1(step))?;
        assert_eq!(bits(&got), bits(&values(&want)), "{dtype:?}: moment1");

        let (a, b) = step.moment2_coefficients();
        let got = emulate("moment2", &[a, b], &[&v, &g]);
        let want = v.copy()?;
        want.inplace_op2(&g, &Moment2(step))?;
        assert_eq!(bits(&got), bits(&values(&want)), "{dtype:?}: moment2");

        let got = emulate("theta", &step.theta_constants(), &[&theta, &m, &v]);
        let want = theta.copy()?;
        want.inplace_op3(&m, &v, &Theta(step))?;
        assert_eq!(bits(&got), bits(&values(&want)), "{dtype:?}: theta");
        // The update moved parameters (in bf16 not all: a step below half
        // a unit in the last place leaves one as it was), so the
        // comparison is not of two copies of the start.
        let moved = values(&want)
            .iter()
            .zip(values(&theta))
            .filter(|(a, b)| **a != *b)
            .count();
        assert!(moved > n / 10, "{dtype:?}: {moved} of {n} parameters moved");
    }
    Ok(())
}
