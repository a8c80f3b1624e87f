//! Matrix products on the CPU: f32 into an output that is never zeroed,
//! bf16 in slices.
//!
//! candle 0.11's product fills its output with zeros before `gemm`
//! overwrites every element: a serial pass over the output on the calling
//! thread, 2% of a GPT step's time on two cores. Here an f32 product of
//! two matrices is the same `gemm` call as candle's, with the same
//! arguments (so the same result, bit for bit), into an output that is
//! only allocated.
//!
//! candle 0.11 has no bf16 matrix kernel on the CPU: it widens both
//! operands' whole storage to f32, multiplies, and narrows the f32 result,
//! so a layer's bf16 product briefly holds its input, its output and its
//! weight again at twice the size (for a batch of 4096 through 512 features
//! that is 17 MiB beside a 4 MiB output). Here the longer of the left
//! operand's two dimensions is widened a slice at a time. When that is its
//! rows (a layer's forward and its input's gradient), the right operand is
//! widened whole (a weight) and each slice's f32 result is narrowed into
//! the bf16 output as it is made. When it is the shared dimension (a
//! weight's gradient, summed over the batch), a slice of each operand is
//! widened and the slices' products are summed in one f32 result, so two
//! f32 buffers the output's size (the sum and a slice's product) are held,
//! which for a weight's gradient are weight-sized. The products are f32
//! `gemm` as candle's, so results are candle's but for a last-bit rounding
//! where a sum's order differs.

use candle_core::{bail, DType, Result, Storage, Tensor};
use half::{bf16, slice::HalfFloatSliceExt, vec::HalfFloatVecExt};
use rayon::prelude::*;

use crate::cpu::with_slice;

/// Elements each task of the thread pool widens.
const WIDEN_SPAN: usize = 1 << 15;

/// Rows, or shared-dimension entries, of a bf16 product on the CPU widened
/// to f32 at once: 256 of 512 features are half a MiB in f32, small beside
/// the operands and large enough for `gemm` to run at full speed. A product
/// whose operands are no longer is candle's, whole, so its f32 working set
/// grows with its rows up to this size and then stays the same: what a
/// planner predicting a bf16 step's peak from small batches needs to know.
pub const BF16_SLICE: usize = 256;
const SLICE: usize = BF16_SLICE;

/// `a b` for 2-D `a` `(m, k)` and `b` `(k, n)`, either may be a transposed
/// view. f32 on the CPU is `gemm` into an output that is not zeroed first,
/// bf16 goes slice by slice (see the module); any other dtype, device or
/// rank is candle's `matmul`.
pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if let Some(out) = f32_product(a, b)? {
        return Ok(out);
    }
    let sliced = a.device().is_cpu()
        && a.dtype() == DType::BF16
        && b.dtype() == DType::BF16
        && a.rank() == 2
        && b.rank() == 2;
    if !sliced {
        return a.matmul(b);
    }
    let ((m, k), (k2, n)) = (a.dims2()?, b.dims2()?);
    if k != k2 || m * k * n == 0 || m.max(k) <= SLICE {
        // A mismatch is candle's error to report; small products gain nothing.
        return a.matmul(b);
    }
    if m >= k {
        by_rows(a, b, m, n)
    } else {
        by_depth(a, b, k, (m, n))
    }
}

/// `a b` for f32 matrices on the CPU through `gemm` as candle calls it,
/// without zeroing the output first; `None` where that does not apply (a
/// mismatch is candle's error to report, an empty product candle's to
/// make).
fn f32_product(a: &Tensor, b: &Tensor) -> Result<Option<Tensor>> {
    let applies = a.device().is_cpu()
        && b.device().is_cpu()
        && a.dtype() == DType::F32
        && b.dtype() == DType::F32
        && a.rank() == 2
        && b.rank() == 2;
    if !applies {
        return Ok(None);
    }
    let ((m, k), (k2, n)) = (a.dims2()?, b.dims2()?);
    if k != k2 || m * k * n == 0 {
        return Ok(None);
    }
    let (a_storage, a_layout) = a.storage_and_layout();
    let (b_storage, b_layout) = b.storage_and_layout();
    let (Storage::Cpu(a_cpu), Storage::Cpu(b_cpu)) = (&*a_storage, &*b_storage) else {
        return Ok(None);
    };
    let (lhs, rhs) = (a_cpu.as_slice::<f32>()?, b_cpu.as_slice::<f32>()?);
    let (a_stride, b_stride) = (a_layout.stride(), b_layout.stride());
    // The last element each operand reads lies inside its storage (strides
    // of a valid layout; checked, since `gemm` reads through pointers).
    let last = |start: usize, stride: &[usize], rows: usize, cols: usize| {
        start + (rows - 1) * stride[0] + (cols - 1) * stride[1]
    };
    if last(a_layout.start_offset(), a_stride, m, k) >= lhs.len()
        || last(b_layout.start_offset(), b_stride, k, n) >= rhs.len()
    {
        return Ok(None);
    }
    let threads = candle_core::utils::get_num_threads();
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    let mut out: Vec<f32> = Vec::with_capacity(m * n);
    // SAFETY: both operands' elements lie inside their slices (checked
    // above); `out` has room for the m x n row-major result, which `gemm`
    // writes in full without reading it (`read_dst` false, k > 0), before
    // its length is set.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            lhs[a_layout.start_offset()..].as_ptr(),
            a_stride[1] as isize,
            a_stride[0] as isize,
            rhs[b_layout.start_offset()..].as_ptr(),
            b_stride[1] as isize,
            b_stride[0] as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
        out.set_len(m * n);
    }
    drop((a_storage, b_storage));
    Ok(Some(Tensor::from_vec(out, (m, n), a.device())?))
}

/// `t` in f32. A bf16 matrix whose rows are contiguous (a matrix, or a
/// slice of its rows or of its columns), or the transpose of one (a
/// layer's weight as the forward reads it, a slice of a gradient as a
/// weight's gradient reads it), is widened on the thread pool by `half`'s
/// vectorised conversion; anything else by candle's `to_dtype`, which
/// converts element by element on one thread (a fifth of a bf16 GPT step's
/// time on two cores). Exact either way.
fn widen(t: &Tensor) -> Result<Tensor> {
    let applies = t.device().is_cpu() && t.dtype() == DType::BF16 && t.rank() == 2;
    if !applies || t.elem_count() == 0 {
        return t.to_dtype(DType::F32);
    }
    let (rows, cols) = t.dims2()?;
    let stride = t.layout().stride().to_vec();
    if stride[1] != 1 && (stride[0] == 1 || rows == 1) {
        return widen(&t.t()?)?.t();
    }
    if stride[1] != 1 && cols > 1 {
        return t.to_dtype(DType::F32);
    }
    // Row `r` is the `cols` elements from `start + r * stride[0]`.
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return t.to_dtype(DType::F32);
    };
    let v = cpu.as_slice::<bf16>()?;
    let (start, step) = (layout.start_offset(), if rows == 1 { 0 } else { stride[0] });
    if start + (rows - 1) * step + cols > v.len() {
        bail!("internal: a bf16 matrix's rows lie outside its storage");
    }
    let mut out = vec![0f32; rows * cols];
    let rows_per_task = (WIDEN_SPAN / cols).max(1);
    out.par_chunks_mut(rows_per_task * cols)
        .enumerate()
        .for_each(|(task, o)| {
            for (i, o) in o.chunks_exact_mut(cols).enumerate() {
                let r = task * rows_per_task + i;
                v[start + r * step..][..cols].convert_to_f32_slice(o);
            }
        });
    drop(storage);
    Tensor::from_vec(out, (rows, cols), t.device())
}

/// The output's rows a slice at a time, `b` widened once.
fn by_rows(a: &Tensor, b: &Tensor, m: usize, n: usize) -> Result<Tensor> {
    let b32 = widen(b)?;
    let mut out: Vec<bf16> = Vec::with_capacity(m * n);
    for start in (0..m).step_by(SLICE) {
        let rows = SLICE.min(m - start);
        let part = widen(&a.narrow(0, start, rows)?)?.matmul(&b32)?;
        with_slice::<f32, _>(&part, |v| {
            let from = out.len();
            out.resize(from + v.len(), bf16::ZERO);
            out[from..].convert_from_f32_slice(v);
        })?;
    }
    Tensor::from_vec(out, (m, n), a.device())
}

/// The sum over slices of the shared dimension, in one f32 result.
fn by_depth(a: &Tensor, b: &Tensor, k: usize, (m, n): (usize, usize)) -> Result<Tensor> {
    let mut sum = vec![0f32; m * n];
    for start in (0..k).step_by(SLICE) {
        let depth = SLICE.min(k - start);
        let a32 = widen(&a.narrow(1, start, depth)?)?;
        let b32 = widen(&b.narrow(0, start, depth)?)?;
        let part = a32.matmul(&b32)?;
        drop((a32, b32));
        with_slice::<f32, _>(&part, |v| sum.iter_mut().zip(v).for_each(|(s, p)| *s += p))?;
    }
    let out: Vec<bf16> = Vec::from_f32_slice(&sum);
    drop(sum);
    Tensor::from_vec(out, (m, n), a.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Values in [-2, 2) from a fixed sequence, in bf16.
    fn data(rows: usize, cols: usize, seed: u32) -> Result<Tensor> {
        let v: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let h = (i as u32 ^ seed).wrapping_mul(2_654_435_761) >> 8;
                h as f32 / (1u32 << 22) as f32 - 2.0
            })
            .collect();
        Tensor::from_vec(v, (rows, cols), &Device::Cpu)?.to_dtype(DType::BF16)
    }

    /// The largest distance between the two in bf16 steps (units in the
    /// last place; where the two have one sign: near zero a sign can flip),
    /// and the largest difference from the product in f64 of the same bf16
    /// inputs, relative to the largest magnitude.
    fn compare(a: &Tensor, b: &Tensor) -> Result<(u16, f64)> {
        let ours = matmul(a, b)?;
        let candle = a.matmul(b)?;
        assert_eq!(ours.dims(), candle.dims());
        assert_eq!(ours.dtype(), DType::BF16);
        assert!(ours.is_contiguous());
        let bits = |t: &Tensor| -> Result<Vec<u16>> {
            Ok(t.flatten_all()?
                .to_vec1::<bf16>()?
                .iter()
                .map(|v| v.to_bits())
                .collect())
        };
        let ulps = bits(&ours)?
            .iter()
            .zip(bits(&candle)?)
            .filter(|(x, y)| (*x ^ y) & 0x8000 == 0)
            .map(|(x, y)| x.abs_diff(y))
            .max()
            .unwrap_or(0);
        let exact = a.to_dtype(DType::F64)?.matmul(&b.to_dtype(DType::F64)?)?;
        let scale = exact.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
        let diff = (ours.to_dtype(DType::F64)? - &exact)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f64>()?;
        Ok((ulps, diff / scale))
    }

    #[test]
    fn widening_any_view_equals_candles_conversion() -> Result<()> {
        let m = data(300, 90, 4)?;
        let views = [
            m.clone(),
            m.t()?,
            // A slice of rows of a transposed matrix: a weight's gradient
            // reads its output's gradient so when the two are as long.
            m.t()?.narrow(0, 20, 50)?,
            m.narrow(1, 10, 40)?,
            m.narrow(0, 5, 1)?,
            m.narrow(1, 7, 1)?,
            m.narrow(0, 3, 1)?.broadcast_as((6, 90))?,
            m.narrow(1, 3, 1)?.broadcast_as((300, 4))?,
        ];
        for (i, v) in views.iter().enumerate() {
            let ours = widen(v)?;
            assert_eq!(ours.dims(), v.dims(), "view {i}");
            assert_eq!(
                ours.to_vec2::<f32>()?,
                v.to_dtype(DType::F32)?.to_vec2::<f32>()?,
                "view {i}"
            );
        }
        Ok(())
    }

    #[test]
    fn equals_candles_product_but_for_a_last_bit() -> Result<()> {
        // Rows sliced (a layer's forward and input gradient), the depth
        // sliced (a weight's gradient), slices that do not divide the
        // length, and transposed views on either side (rows of a
        // transposed left operand: a weight's gradient over a batch
        // smaller than the layer's outputs).
        let cases = [
            (data(600, 300, 1)?, data(300, 200, 2)?),
            (data(200, 600, 11)?.t()?, data(200, 150, 12)?),
            (data(600, 300, 3)?, data(200, 300, 4)?.t()?),
            (data(700, 250, 5)?.t()?, data(700, 130, 6)?),
            (data(250, 700, 7)?, data(700, 130, 8)?),
            (data(513, 257, 9)?.t()?, data(130, 513, 10)?.t()?),
        ];
        for (i, (a, b)) in cases.iter().enumerate() {
            let (ulps, rel) = compare(a, b)?;
            println!("case {i}: {ulps} ulp from candle's, {rel:.2e} of the largest from f64");
            assert!(ulps <= 1, "case {i}: {ulps} ulp");
            // bf16 keeps 8 bits: a rounding is at most 2^-8 of a value,
            // so of the largest.
            assert!(rel < 4e-3, "case {i}: {rel}");
        }
        Ok(())
    }

    #[test]
    fn f32_products_equal_candles_bit_for_bit_on_every_layout() -> Result<()> {
        // A layer's forward (`x W^T`), its input's gradient (`g W`) and its
        // weight's gradient (`g^T x`), a narrowed view, and a vector.
        let f = |rows, cols, seed| data(rows, cols, seed)?.to_dtype(DType::F32);
        let cases = [
            (f(600, 300, 1)?, f(200, 300, 2)?.t()?),
            (f(600, 200, 3)?, f(200, 300, 4)?),
            (f(600, 200, 5)?.t()?, f(600, 300, 6)?),
            (f(600, 300, 7)?.narrow(1, 10, 250)?, f(250, 9, 8)?),
            (f(1, 300, 9)?, f(300, 1, 10)?),
        ];
        for (i, (a, b)) in cases.iter().enumerate() {
            let ours = matmul(a, b)?;
            assert!(f32_product(a, b)?.is_some(), "case {i} takes gemm directly");
            let bits = |t: &Tensor| -> Result<Vec<u32>> {
                Ok(t.flatten_all()?
                    .to_vec1::<f32>()?
                    .iter()
                    .map(|x| x.to_bits())
                    .collect())
            };
            assert_eq!(ours.dims(), a.matmul(b)?.dims(), "case {i}");
            assert_eq!(bits(&ours)?, bits(&a.matmul(b)?)?, "case {i}");
        }
        Ok(())
    }

    #[test]
    fn other_dtypes_and_small_or_mismatched_products_are_candles() -> Result<()> {
        let (a, b) = (data(600, 300, 1)?, data(300, 200, 2)?);
        for dtype in [DType::F32, DType::F16] {
            let (a, b) = (a.to_dtype(dtype)?, b.to_dtype(dtype)?);
            let (ours, theirs) = (matmul(&a, &b)?, a.matmul(&b)?);
            assert_eq!(ours.dtype(), dtype);
            assert_eq!(
                ours.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
                theirs
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?
            );
        }
        let (small, small_b) = (data(20, 30, 1)?, data(30, 10, 2)?);
        assert_eq!(
            matmul(&small, &small_b)?.to_vec2::<bf16>()?,
            small.matmul(&small_b)?.to_vec2::<bf16>()?
        );
        let err = matmul(&a, &data(301, 200, 3)?).unwrap_err().to_string();
        assert!(err.contains("shape mismatch"), "{err}");
        let empty = Tensor::zeros((600, 0), DType::BF16, &Device::Cpu)?;
        let zeros = matmul(&empty, &Tensor::zeros((0, 200), DType::BF16, &Device::Cpu)?)?;
        assert_eq!(zeros.dims(), [600, 200]);
        Ok(())
    }
}
