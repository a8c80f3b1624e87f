//! The parameters of the activation-gradient kernels
//! (`kernels/activation.cu`) and of the cross-entropy's
//! (`kernels/cross_entropy.cu`), as `cuda.rs` and `cuda_loss.rs` pass them;
//! the test holds them to every kernel's own declaration.

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

kernel_params! {
    /// `cross_entropy_loss_<T>`: each of `rows` rows' loss,
    /// `logsumexp(z) - z[target]`, over `classes` logits.
    pub(crate) struct CrossEntropyLoss<T> {
        loss: Out<f64>,
        logits: In<T>,
        targets: In<u32>,
        rows: usize,
        classes: usize,
    }
}

kernel_params! {
    /// `cross_entropy_grad_<T>`: `(softmax(z) - onehot(target)) * scale`
    /// for each of `rows` rows of `classes` logits.
    pub(crate) struct CrossEntropyGrad<T> {
        out: Out<T>,
        logits: In<T>,
        targets: In<u32>,
        rows: usize,
        classes: usize,
        scale: f64,
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use candle_kernel_params::{Elem, Params};

    use super::*;

    #[test]
    fn every_kernel_takes_what_its_launch_passes() {
        let kernels = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        let mut declared = candle_toolkit_cuda_emulation::declarations(&[
            &kernels.join("activation.cu"),
            &kernels.join("cross_entropy.cu"),
        ]);
        fn each<T: Elem>() -> [(&'static str, Vec<String>); 4] {
            [
                ("relu_grad", ActGrad::<T>::c_params()),
                ("gelu_grad", ActGrad::<T>::c_params()),
                ("cross_entropy_loss", CrossEntropyLoss::<T>::c_params()),
                ("cross_entropy_grad", CrossEntropyGrad::<T>::c_params()),
            ]
        }
        for (suffix, kernels) in [
            ("f32", each::<f32>()),
            ("f64", each::<f64>()),
            ("f16", each::<half::f16>()),
            ("bf16", each::<half::bf16>()),
        ] {
            for (kernel, params) in kernels {
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
