//! The AdamW update as in-place element-wise operations.
//!
//! The arithmetic and its order are `candle_nn::AdamW`'s, so that f32
//! results are equal: candle multiplies by a scalar as `x * c + 0` with the
//! scalar cast to the element type, and adds one as `x * 1 + c`.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, InplaceOp2, InplaceOp3, Layout, Result};
use half::{bf16, f16};

/// The constants of AdamW's step number `t`: the hyper-parameters and the
/// bias corrections `1 / (1 - beta^t)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    pub(crate) beta1: f64,
    pub(crate) beta2: f64,
    pub(crate) lr: f64,
    pub(crate) weight_decay: f64,
    pub(crate) eps: f64,
    pub(crate) scale_m: f64,
    pub(crate) scale_v: f64,
}

impl AdamWStep {
    /// The constants of step `t` (counted from 1) with `p`; an error where
    /// a bias correction would divide by 0 (step 0, or a beta of 1), which
    /// would step every weight to NaN.
    pub fn new(p: &candle_nn::ParamsAdamW, t: usize) -> Result<Self> {
        let power = i32::try_from(t).unwrap_or(i32::MAX);
        let (scale_m, scale_v) = (
            1.0 / (1.0 - p.beta1.powi(power)),
            1.0 / (1.0 - p.beta2.powi(power)),
        );
        let beta = 0.0..1.0;
        let corrected = scale_m.is_finite() && scale_v.is_finite();
        if !(corrected && beta.contains(&p.beta1) && beta.contains(&p.beta2)) {
            bail!(
                "AdamW's step {t} with beta1 {} and beta2 {} has no bias correction \
                 (1 - beta^t is 0) or betas outside AdamW's; allowed: a step from 1, betas from \
                 0 to below 1",
                p.beta1,
                p.beta2
            );
        }
        Ok(Self {
            beta1: p.beta1,
            beta2: p.beta2,
            lr: p.lr,
            weight_decay: p.weight_decay,
            eps: p.eps,
            scale_m,
            scale_v,
        })
    }

    /// `(a, b)` of the first moment's `a m + b g`, as both kernels take
    /// them.
    pub(crate) fn moment1_coefficients(&self) -> (f64, f64) {
        (self.beta1, 1.0 - self.beta1)
    }

    /// `(a, b)` of the second moment's `a v + b g²`, as both kernels take
    /// them.
    pub(crate) fn moment2_coefficients(&self) -> (f64, f64) {
        (self.beta2, 1.0 - self.beta2)
    }

    /// The update's constants as both kernels take them: the bias
    /// corrections, the decay `1 - lr wd`, the learning rate and epsilon.
    pub(crate) fn theta_constants(&self) -> [f64; 5] {
        let decay = 1.0 - self.lr * self.weight_decay;
        [self.scale_m, self.scale_v, decay, self.lr, self.eps]
    }
}

/// A float type the kernel computes in.
trait Real: Copy {
    fn c(x: f64) -> Self;
    fn add(self, o: Self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn div(self, o: Self) -> Self;
    fn sqrt(self) -> Self;
}

macro_rules! real {
    ($t:ty) => {
        impl Real for $t {
            fn c(x: f64) -> Self {
                x as $t
            }
            fn add(self, o: Self) -> Self {
                self + o
            }
            fn sub(self, o: Self) -> Self {
                self - o
            }
            fn mul(self, o: Self) -> Self {
                self * o
            }
            fn div(self, o: Self) -> Self {
                self / o
            }
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
        }
    };
}
real!(f32);
real!(f64);

/// `x * c + 0`, candle's scalar multiplication.
fn scal<T: Real>(x: T, c: f64) -> T {
    x.mul(T::c(c)).add(T::c(0.0))
}

fn moment1<T: Real>(m: T, g: T, s: &AdamWStep) -> T {
    let (a, b) = s.moment1_coefficients();
    scal(m, a).add(scal(g, b))
}

fn moment2<T: Real>(v: T, g: T, s: &AdamWStep) -> T {
    let (a, b) = s.moment2_coefficients();
    scal(v, a).add(scal(g.mul(g), b))
}

fn theta<T: Real>(theta: T, m: T, v: T, s: &AdamWStep) -> T {
    let [scale_m, scale_v, decay, lr, eps] = s.theta_constants();
    let m_hat = scal(m, scale_m);
    let v_hat = scal(v, scale_v);
    let decayed = scal(theta, decay);
    // `+ eps` is candle's affine(1, eps).
    let denom = v_hat.sqrt().mul(T::c(1.0)).add(T::c(eps));
    decayed.sub(scal(m_hat.div(denom), lr))
}

/// The element range of a contiguous layout, or an error naming `what`.
pub(crate) fn range(l: &Layout, what: &str) -> Result<(usize, usize)> {
    match l.contiguous_offsets() {
        Some(r) => Ok(r),
        None => bail!("the {what} is not contiguous"),
    }
}

/// Applies `f(dst, a)` element-wise, in f32 for the half types.
fn zip2(
    dst: &mut CpuStorage,
    dl: &Layout,
    a: &CpuStorage,
    al: &Layout,
    f32_op: impl Fn(f32, f32) -> f32,
    f64_op: impl Fn(f64, f64) -> f64,
) -> Result<()> {
    let (ds, de) = range(dl, "optimizer state")?;
    let (as_, ae) = range(al, "gradient")?;
    if de - ds != ae - as_ {
        bail!("state of {} elements, gradient of {}", de - ds, ae - as_);
    }
    macro_rules! go {
        ($d:expr, $a:expr, $to:expr, $from:expr, $op:expr) => {
            for (d, a) in $d[ds..de].iter_mut().zip(&$a[as_..ae]) {
                *d = $from($op($to(*d), $to(*a)));
            }
        };
    }
    match (dst, a) {
        (CpuStorage::F32(d), CpuStorage::F32(a)) => go!(d, a, |x| x, |x| x, f32_op),
        (CpuStorage::F64(d), CpuStorage::F64(a)) => go!(d, a, |x| x, |x| x, f64_op),
        (CpuStorage::F16(d), CpuStorage::F16(a)) => {
            go!(d, a, f16::to_f32, f16::from_f32, f32_op)
        }
        (CpuStorage::BF16(d), CpuStorage::BF16(a)) => {
            go!(d, a, bf16::to_f32, bf16::from_f32, f32_op)
        }
        (d, a) => bail!(
            "AdamW: state is {:?}, gradient {:?}: both must be the same float type",
            d.dtype(),
            a.dtype()
        ),
    }
    Ok(())
}

/// `m <- beta1 m + (1 - beta1) g`.
pub(crate) struct Moment1(pub AdamWStep);
/// `v <- beta2 v + (1 - beta2) g^2`.
pub(crate) struct Moment2(pub AdamWStep);
/// `theta <- theta (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)`.
pub(crate) struct Theta(pub AdamWStep);

impl InplaceOp2 for Moment1 {
    fn name(&self) -> &'static str {
        "adamw-moment1"
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        m: &mut candle_core::CudaStorage,
        ml: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<()> {
        crate::cuda::moment("moment1", m, ml, g, gl, self.0.moment1_coefficients())
    }
    fn cpu_fwd(&self, m: &mut CpuStorage, ml: &Layout, g: &CpuStorage, gl: &Layout) -> Result<()> {
        let s = self.0;
        zip2(
            m,
            ml,
            g,
            gl,
            |m, g| moment1(m, g, &s),
            |m, g| moment1(m, g, &s),
        )
    }
}

impl InplaceOp2 for Moment2 {
    fn name(&self) -> &'static str {
        "adamw-moment2"
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        v: &mut candle_core::CudaStorage,
        vl: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<()> {
        crate::cuda::moment("moment2", v, vl, g, gl, self.0.moment2_coefficients())
    }
    fn cpu_fwd(&self, v: &mut CpuStorage, vl: &Layout, g: &CpuStorage, gl: &Layout) -> Result<()> {
        let s = self.0;
        zip2(
            v,
            vl,
            g,
            gl,
            |v, g| moment2(v, g, &s),
            |v, g| moment2(v, g, &s),
        )
    }
}

impl InplaceOp3 for Theta {
    fn name(&self) -> &'static str {
        "adamw-theta"
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        t: &mut candle_core::CudaStorage,
        tl: &Layout,
        m: &candle_core::CudaStorage,
        ml: &Layout,
        v: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> Result<()> {
        crate::cuda::theta(t, tl, m, ml, v, vl, &self.0)
    }
    fn cpu_fwd(
        &self,
        t: &mut CpuStorage,
        tl: &Layout,
        m: &CpuStorage,
        ml: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> Result<()> {
        let s = self.0;
        let (ts, te) = range(tl, "parameter")?;
        let (ms, me) = range(ml, "first moment")?;
        let (vs, ve) = range(vl, "second moment")?;
        if te - ts != me - ms || te - ts != ve - vs {
            bail!("parameter and moments differ in size");
        }
        macro_rules! go {
            ($t:expr, $m:expr, $v:expr, $to:expr, $from:expr) => {
                for ((t, m), v) in $t[ts..te].iter_mut().zip(&$m[ms..me]).zip(&$v[vs..ve]) {
                    *t = $from(theta($to(*t), $to(*m), $to(*v), &s));
                }
            };
        }
        match (t, m, v) {
            (CpuStorage::F32(t), CpuStorage::F32(m), CpuStorage::F32(v)) => {
                go!(t, m, v, |x| x, |x| x)
            }
            (CpuStorage::F64(t), CpuStorage::F64(m), CpuStorage::F64(v)) => {
                go!(t, m, v, |x| x, |x| x)
            }
            (CpuStorage::F16(t), CpuStorage::F16(m), CpuStorage::F16(v)) => {
                go!(t, m, v, f16::to_f32, f16::from_f32)
            }
            (CpuStorage::BF16(t), CpuStorage::BF16(m), CpuStorage::BF16(v)) => {
                go!(t, m, v, bf16::to_f32, bf16::from_f32)
            }
            (t, _, _) => bail!(
                "AdamW: parameter is {:?}; parameter and moments must be the same float type",
                t.dtype()
            ),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::AdamWStep;
    use candle_nn::ParamsAdamW;

    #[test]
    fn a_step_without_a_bias_correction_is_an_error() {
        let p = ParamsAdamW::default();
        let e = AdamWStep::new(&p, 0).unwrap_err().to_string();
        assert_eq!(
            e.lines().next(),
            Some(
                "AdamW's step 0 with beta1 0.9 and beta2 0.999 has no bias correction \
                 (1 - beta^t is 0) or betas outside AdamW's; allowed: a step from 1, betas \
                 from 0 to below 1"
            )
        );
        let flat = ParamsAdamW {
            beta1: 1.0,
            ..Default::default()
        };
        assert!(AdamWStep::new(&flat, 5).is_err());
        let over = ParamsAdamW {
            beta1: 1.5,
            ..Default::default()
        };
        assert!(AdamWStep::new(&over, 5).is_err());
        let first = AdamWStep::new(&p, 1).unwrap();
        assert_eq!(
            (first.scale_m, first.scale_v),
            (1.0 / (1.0 - 0.9), 1.0 / (1.0 - 0.999))
        );
    }
}
