//! The flash kernels' parameters (`kernels/flash.cuh`), as
//! `flash_cuda.rs` passes them: tensors contiguous `(batch, heads, n,
//! width)`, then `nq, nk, d, dv, q_heads, group` (i32, which
//! `flash_plan::plan` checked they fit), the scale and whether the mask is
//! causal. The test holds each to every kernel's own declaration.

use candle_kernel_params::{kernel_params, In, Out};

kernel_params! {
    /// `flash_forward_<D>_<T>`: the output and each row's log-sum-exp.
    pub(crate) struct Forward<T> {
        q: In<T>,
        k: In<T>,
        v: In<T>,
        out: Out<T>,
        lse: Out<f32>,
        nq: i32,
        nk: i32,
        d: i32,
        dv: i32,
        hq: i32,
        group: i32,
        scale: f32,
        causal: i32,
    }
}

kernel_params! {
    /// `flash_delta_<D>_<T>`: `rowsum(d_out * out)` for each of `rows`
    /// rows of `dv` elements.
    pub(crate) struct Delta<T> {
        d_out: In<T>,
        out: In<T>,
        dl: Out<f32>,
        rows: usize,
        dv: i32,
    }
}

kernel_params! {
    /// `flash_backward_kv_<D>_<T>`: dK and dV.
    pub(crate) struct BackwardKv<T> {
        q: In<T>,
        k: In<T>,
        v: In<T>,
        d_out: In<T>,
        lse: In<f32>,
        dl: In<f32>,
        dk: Out<T>,
        dv_out: Out<T>,
        nq: i32,
        nk: i32,
        d: i32,
        dv: i32,
        hq: i32,
        group: i32,
        scale: f32,
        causal: i32,
    }
}

kernel_params! {
    /// `flash_backward_q_<D>_<T>`: dQ.
    pub(crate) struct BackwardQ<T> {
        q: In<T>,
        k: In<T>,
        v: In<T>,
        d_out: In<T>,
        lse: In<f32>,
        dl: In<f32>,
        dq: Out<T>,
        nq: i32,
        nk: i32,
        d: i32,
        dv: i32,
        hq: i32,
        group: i32,
        scale: f32,
        causal: i32,
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use candle_kernel_params::{Elem, Params};

    use super::*;

    fn expect<T: Elem>(suffix: &str, d: usize) -> Vec<(String, Vec<String>)> {
        vec![
            (
                format!("flash_forward_{d}_{suffix}"),
                Forward::<T>::c_params(),
            ),
            (format!("flash_delta_{d}_{suffix}"), Delta::<T>::c_params()),
            (
                format!("flash_backward_kv_{d}_{suffix}"),
                BackwardKv::<T>::c_params(),
            ),
            (
                format!("flash_backward_q_{d}_{suffix}"),
                BackwardQ::<T>::c_params(),
            ),
        ]
    }

    #[test]
    fn every_kernel_takes_what_its_launch_passes() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        let files = [32, 64, 128].map(|d| dir.join(format!("flash_{d}.cu")));
        let mut declared =
            candle_toolkit_cuda_emulation::declarations(&files.each_ref().map(|p| p.as_path()));
        for d in [32, 64, 128] {
            let launches = [
                expect::<f32>("f32", d),
                expect::<half::f16>("f16", d),
                expect::<half::bf16>("bf16", d),
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
        }
        // Each kernel the modules define has its launch's parameters here.
        assert!(declared.is_empty(), "not launched: {:?}", declared.keys());
    }
}
