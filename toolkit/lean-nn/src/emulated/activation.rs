//! The activation-gradient kernels (`kernels/activation.cu`), run on the
//! CPU by `tests/emulated/activation.cpp`, against the bits of candle's
//! composed operations on the CPU (`composed_act_grad`), which the kernel
//! claims to repeat: the same operations in the same order, each rounded on
//! its own, and candle's scalar constants cast as candle casts them.

use candle_core::{DType, Device, Result, Tensor};
use candle_toolkit_cuda_emulation::Build;

use super::{bits, harness, values};
use crate::linear::composed_act_grad;
use crate::Activation;

#[test]
fn the_kernels_give_the_composed_operations_bits_in_every_dtype() -> Result<()> {
    let n = 1000;
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let r = |std: f32| -> Result<Tensor> {
            Tensor::randn(0f32, std, n, &Device::Cpu)?.to_dtype(dtype)
        };
        // GELU's input over the range where its derivative bends; a ReLU's
        // output is 0 or positive.
        let (g, z) = (r(1.0)?, r(3.0)?);
        let relu_out = z.relu()?;
        for (act, kernel, saved) in [
            (Activation::Relu, "relu_grad", &relu_out),
            (Activation::Gelu, "gelu_grad", &z),
        ] {
            let name = format!("{kernel}_{}", dtype.as_str());
            let input: Vec<f64> = values(&g).into_iter().chain(values(saved)).collect();
            // 3 blocks of 64 threads: the grid-stride loop covers the rest.
            let got = candle_toolkit_cuda_emulation::run_on_f64(
                &harness("activation", Build::Plain),
                &[&name, "3", "64", &n.to_string()],
                &input,
            );
            let want = values(&composed_act_grad(&g, saved, act)?);
            assert_eq!(bits(&got), bits(&want), "{name}");
        }
    }
    Ok(())
}
