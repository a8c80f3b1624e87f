//! AdamW's kernels' parameters (`kernels/adamw.cu`), as `cuda.rs` passes
//! them; the test holds each to every kernel's own declaration.

use candle_kernel_params::{kernel_params, In, Out};

kernel_params! {
    /// `adamw_moment1_<T>` and `adamw_moment2_<T>`: `dst <- a dst + b g`
    /// (or `b g²`) over `n` elements.
    pub(crate) struct Moment<T> {
        dst: Out<T>,
        g: In<T>,
        n: usize,
        a: f64,
        b: f64,
    }
}

kernel_params! {
    /// `adamw_theta_<T>`: the parameter's update from both moments.
    pub(crate) struct Theta<T> {
        theta: Out<T>,
        m: In<T>,
        v: In<T>,
        n: usize,
        scale_m: f64,
        scale_v: f64,
        decay: f64,
        lr: f64,
        eps: f64,
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use candle_kernel_params::{Elem, Params};

    use super::*;

    fn expect<T: Elem>(suffix: &str) -> [(String, Vec<String>); 3] {
        [
            (format!("adamw_moment1_{suffix}"), Moment::<T>::c_params()),
            (format!("adamw_moment2_{suffix}"), Moment::<T>::c_params()),
            (format!("adamw_theta_{suffix}"), Theta::<T>::c_params()),
        ]
    }

    #[test]
    fn every_kernel_takes_what_its_launch_passes() {
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/adamw.cu");
        let mut declared = candle_toolkit_cuda_emulation::declarations(&[&source]);
        let launches = [
            expect::<f32>("f32"),
            expect::<f64>("f64"),
            expect::<half::f16>("f16"),
            expect::<half::bf16>("bf16"),
        ];
        for (name, params) in launches.into_iter().flatten() {
            let Some(c) = declared.remove(&name) else {
                panic!("no kernel is named {name}");
            };
            assert_eq!(
                params, c,
                "{name}: what the launch passes, then the declaration"
            );
        }
        assert!(declared.is_empty(), "not launched: {:?}", declared.keys());
    }
}
