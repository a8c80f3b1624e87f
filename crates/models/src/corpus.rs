//! A corpus generated in code: arithmetic sequences modulo the vocabulary.

use crate::Rng;
use candle_core::{Device, Result, Tensor};

/// A batch of `b` sequences of `s` tokens and their next tokens. Each row
/// counts from a random start by a random step of 1 to 4, modulo `vocab`:
/// a model that has read two tokens of a row can predict the rest, so the
/// loss of a model that learns falls from `ln(vocab)` towards zero.
///
/// ```
/// use workbook_models::Rng;
/// use workbook_models::corpus::batch;
/// let (x, y) = batch(&mut Rng::seeded(1), 2, 5, 7, &candle_core::Device::Cpu)?;
/// let (x, y) = (x.to_vec2::<u32>()?, y.to_vec2::<u32>()?);
/// for (xr, yr) in x.iter().zip(&y) {
///     assert_eq!(xr[1..], yr[..4]);
///     let step = (xr[1] + 7 - xr[0]) % 7;
///     assert!((1..=4).contains(&step) && (yr[4] + 7 - xr[4]) % 7 == step);
/// }
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn batch(
    rng: &mut Rng,
    b: usize,
    s: usize,
    vocab: usize,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let v = vocab as u32;
    let starts = rng.labels(b, v, device)?.to_vec1::<u32>()?;
    let steps = rng.labels(b, 4, device)?.to_vec1::<u32>()?;
    let mut tokens = Vec::with_capacity(b * (s + 1));
    for (start, step) in starts.into_iter().zip(steps) {
        let step = step + 1;
        tokens.extend((0..=s as u32).map(|t| (start + t * step) % v));
    }
    let all = Tensor::from_vec(tokens, (b, s + 1), device)?;
    Ok((
        all.narrow(1, 0, s)?.contiguous()?,
        all.narrow(1, 1, s)?.contiguous()?,
    ))
}
