//! The gradients of q, k and v as the gradient of the one projection that
//! made them.

use candle_core::{bail, DType, Device, Result, Storage, Tensor};
use rayon::prelude::*;

/// `parts`, each `(b, a, s, d)` (q, k and v as the attention takes them),
/// as one `(b, s, n·a·d)` tensor laid out as the projection that made them
/// (`(b, s, n, a, d)`, n the number of parts): the gradient a stacked
/// `qkv` projection's backward takes. On the CPU in f32 one pass writes
/// each row; elsewhere a stack and a copy.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_tiled_attention::pack_heads;
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1.0, (2, 3, 5, 4), &dev)?;
/// let k = Tensor::randn(0f32, 1.0, (2, 3, 5, 4), &dev)?;
/// let packed = pack_heads(&[q.clone(), k.clone()])?;
/// assert_eq!(packed.dims(), [2, 5, 24]);
/// // Row (1, 4), the second part's third head: k[1, 2, 4, ..].
/// let got = packed.get(1)?.get(4)?.narrow(0, 12 + 2 * 4, 4)?;
/// assert_eq!(got.to_vec1::<f32>()?, k.get(1)?.get(2)?.get(4)?.to_vec1::<f32>()?);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn pack_heads(parts: &[Tensor]) -> Result<Tensor> {
    let Some(first) = parts.first() else {
        bail!("pack_heads: no parts to pack");
    };
    let (b, a, s, d) = first.dims4()?;
    for p in parts {
        if p.dims() != first.dims() || p.dtype() != first.dtype() {
            bail!(
                "pack_heads: the parts must share a shape and dtype; {:?} {:?} and {:?} {:?}",
                first.dims(),
                first.dtype(),
                p.dims(),
                p.dtype()
            );
        }
        if !p.device().same_device(first.device()) {
            bail!("pack_heads: the parts are on different devices");
        }
    }
    let n = parts.len();
    if !(first.device().is_cpu() && first.dtype() == DType::F32) {
        return Tensor::stack(parts, 0)?
            .permute((1, 3, 0, 2, 4))?
            .reshape((b, s, n * a * d));
    }
    let parts = parts
        .iter()
        .map(|p| p.contiguous())
        .collect::<Result<Vec<_>>>()?;
    let guards: Vec<_> = parts.iter().map(|p| p.storage_and_layout()).collect();
    let mut slices = Vec::with_capacity(n);
    for (storage, layout) in &guards {
        let (Storage::Cpu(cpu), Some((start, end))) = (&**storage, layout.contiguous_offsets())
        else {
            bail!("internal: pack_heads got a strided or non-CPU part");
        };
        slices.push(&cpu.as_slice::<f32>()?[start..end]);
    }
    let h = a * d;
    let mut out = vec![0f32; b * s * n * h];
    if h > 0 {
        out.par_chunks_mut(n * h)
            .enumerate()
            .for_each(|(row, dst)| {
                let (bi, si) = (row / s, row % s);
                for (part, src) in dst.chunks_exact_mut(h).zip(&slices) {
                    for (ai, head) in part.chunks_exact_mut(d).enumerate() {
                        head.copy_from_slice(&src[((bi * a + ai) * s + si) * d..][..d]);
                    }
                }
            });
    }
    drop(guards);
    Tensor::from_vec(out, (b, s, n * h), &Device::Cpu)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one pass (f32, contiguous parts and transposed views of others)
    /// against the stack and copy it replaces, with an odd number of parts
    /// and heads; bf16 runs the stack and copy itself, its shape checked.
    #[test]
    fn packing_is_the_stack_and_permute() -> Result<()> {
        let dev = Device::Cpu;
        for (dtype, strided) in [
            (DType::F32, false),
            (DType::F32, true),
            (DType::BF16, false),
        ] {
            let part = || -> Result<Tensor> {
                let t = if strided {
                    // (b, a, s, d) as a view of a (b, s, a, d) tensor.
                    Tensor::randn(0f32, 1.0, (2, 7, 3, 5), &dev)?.transpose(1, 2)?
                } else {
                    Tensor::randn(0f32, 1.0, (2, 3, 7, 5), &dev)?
                };
                t.to_dtype(dtype)
            };
            let parts = (0..3).map(|_| part()).collect::<Result<Vec<_>>>()?;
            assert_eq!(parts[0].is_contiguous(), !strided || dtype != DType::F32);
            let want = Tensor::stack(&parts, 0)?
                .permute((1, 3, 0, 2, 4))?
                .reshape((2, 7, 45))?;
            let got = pack_heads(&parts)?;
            assert_eq!(got.dims(), want.dims());
            let diff = (got.to_dtype(DType::F32)? - want.to_dtype(DType::F32)?)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert_eq!(diff, 0.0, "{dtype:?}");
        }
        Ok(())
    }

    #[test]
    fn parts_that_differ_are_refused() -> Result<()> {
        let dev = Device::Cpu;
        let q = Tensor::zeros((1, 2, 3, 4), DType::F32, &dev)?;
        let k = Tensor::zeros((1, 2, 3, 5), DType::F32, &dev)?;
        let err = pack_heads(&[q.clone(), k]).unwrap_err().to_string();
        assert!(
            err.contains("pack_heads: the parts must share a shape and dtype; [1, 2, 3, 4] F32 and [1, 2, 3, 5] F32"),
            "{err}"
        );
        let err = pack_heads(&[]).unwrap_err().to_string();
        assert!(err.contains("pack_heads: no parts to pack"), "{err}");
        let err = pack_heads(&[q.flatten_all()?]).unwrap_err().to_string();
        assert!(err.contains("unexpected rank"), "{err}");
        Ok(())
    }
}
