//! The activation-gradient kernels' parameters (`kernels/activation.cu`),
//! as `cuda.rs` passes them; the test holds them to every kernel's own
//! declaration.

use candle_kernel_params::{kernel_params, In, Out};

kernel_params! {
    /// `relu_grad_<T>` and `gelu_grad_<T>`: `out = g * act'(saved)` over
    /// `n` elements.
    pub(crate) struct ActGrad<T> {
        out: Out<T>,
        g: In<T>,
        saved: In<T>,
        n: usize,
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use candle_kernel_params::Params;

    use super::*;

    #[test]
    fn every_kernel_takes_what_its_launch_passes() {
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/activation.cu");
        let mut declared = candle_toolkit_cuda_emulation::declarations(&[&source]);
        for (suffix, params) in [
            ("f32", ActGrad::<f32>::c_params()),
            ("f64", ActGrad::<f64>::c_params()),
            ("f16", ActGrad::<half::f16>::c_params()),
            ("bf16", ActGrad::<half::bf16>::c_params()),
        ] {
            for kernel in ["relu_grad", "gelu_grad"] {
                let name = format!("{kernel}_{suffix}");
                let Some(c) = declared.remove(&name) else {
                    panic!("no kernel is named {name}");
                };
                assert_eq!(
                    params, c,
                    "{name}: what the launch passes, then the declaration"
                );
            }
        }
        assert!(declared.is_empty(), "not launched: {:?}", declared.keys());
    }
}
