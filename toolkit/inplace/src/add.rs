//! `sum += g` on tensors, on the CPU or a CUDA GPU.

use candle_core::{bail, CpuStorage, DType, InplaceOp2, Layout, Result, Tensor};

/// `sum += g` in `sum`'s own storage, where it can be done: the bits of
/// `sum + g` without its new tensor.
///
/// - On the CPU: f32 tensors of one shape, both contiguous, added on
///   rayon's pool.
/// - With the `cuda` feature, on one CUDA GPU: one shape and dtype, `g`
///   contiguous and `sum` [`writable`](crate::writable); candle's addition
///   kernel, the launch of `sum + g`, with `sum`'s buffer as its output.
///
/// `sum` must also be held by nothing else, which only its owner knows.
/// Returns whether it did; where it did not, nothing was written.
pub fn add_assign(sum: &Tensor, g: &Tensor) -> Result<bool> {
    let fits = if sum.device().is_cpu() {
        g.device().is_cpu()
            && sum.dtype() == DType::F32
            && g.dtype() == DType::F32
            && sum.shape() == g.shape()
            && sum.is_contiguous()
            && g.is_contiguous()
    } else {
        fits_on_gpu(sum, g)
    };
    if fits {
        sum.inplace_op2(g, &AddAssign)?;
    }
    Ok(fits)
}

/// Whether [`add_assign`] can write `sum + g` into `sum` on a CUDA GPU.
#[cfg(feature = "cuda")]
fn fits_on_gpu(sum: &Tensor, g: &Tensor) -> bool {
    crate::writable(sum)
        && sum.device().same_device(g.device())
        && sum.dtype() == g.dtype()
        && sum.shape() == g.shape()
        && g.is_contiguous()
}

/// A build without the `cuda` feature writes on no GPU.
#[cfg(not(feature = "cuda"))]
fn fits_on_gpu(_: &Tensor, _: &Tensor) -> bool {
    false
}

/// `sum += g`, element by element, in the sum's storage.
struct AddAssign;

impl InplaceOp2 for AddAssign {
    fn name(&self) -> &'static str {
        "add-assign"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, sl: &Layout, g: &CpuStorage, gl: &Layout) -> Result<()> {
        let (Some((s0, s1)), Some((g0, g1))) = (sl.contiguous_offsets(), gl.contiguous_offsets())
        else {
            bail!("add-assign: the sum and the addend must be contiguous");
        };
        match (s, g) {
            (CpuStorage::F32(s), CpuStorage::F32(g)) if s1 - s0 == g1 - g0 => {
                candle_cpu_math::par_add_assign(&mut s[s0..s1], &g[g0..g1]);
                Ok(())
            }
            _ => bail!("add-assign: f32 tensors of one size only on the CPU"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &mut candle_core::CudaStorage,
        sl: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<()> {
        crate::assign(crate::Binary::Add, s, sl, g, gl)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Storage};

    fn bits(t: &Tensor) -> Result<Vec<u32>> {
        let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(v.iter().map(|v| v.to_bits()).collect())
    }

    /// Where `t`'s f32 elements lie on the CPU.
    fn address(t: &Tensor) -> Result<usize> {
        let (storage, _) = t.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else {
            bail!("not on the CPU")
        };
        Ok(cpu.as_slice::<f32>()?.as_ptr() as usize)
    }

    #[test]
    fn on_the_cpu_f32_is_added_in_place_with_the_bits_of_the_sum() -> Result<()> {
        let dev = Device::Cpu;
        // Past one task's span of the pool, and not a multiple of it.
        let sum = Tensor::randn(0f32, 1.0, (3, 70_001), &dev)?;
        let g = Tensor::randn(0f32, 1.0, (3, 70_001), &dev)?;
        let want = bits(&(&sum + &g)?)?;
        let at = address(&sum)?;
        assert!(add_assign(&sum, &g)?);
        assert_eq!(address(&sum)?, at);
        assert_eq!(bits(&sum)?, want);
        Ok(())
    }

    #[test]
    fn what_it_cannot_add_in_place_it_leaves_untouched() -> Result<()> {
        let dev = Device::Cpu;
        let sum = Tensor::randn(0f32, 1.0, (4, 6), &dev)?;
        let g = Tensor::randn(0f32, 1.0, (4, 6), &dev)?;
        let before = bits(&sum)?;
        let refused = [
            // Another dtype on the CPU.
            (sum.to_dtype(DType::BF16)?, g.to_dtype(DType::BF16)?),
            (sum.clone(), g.to_dtype(DType::F64)?),
            // Another shape, and a transposed (strided) operand each side.
            (sum.clone(), g.reshape((6, 4))?),
            (sum.clone(), g.t()?.contiguous()?.t()?),
            (sum.t()?, g.t()?.contiguous()?),
        ];
        for (s, g) in &refused {
            let held = bits(s)?;
            assert!(!add_assign(s, g)?, "{:?} {:?}", s.layout(), g.layout());
            assert_eq!(bits(s)?, held);
        }
        assert_eq!(bits(&sum)?, before);
        Ok(())
    }
}
