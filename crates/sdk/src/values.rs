//! Small helpers every cell needs for its parameters and figures: a
//! dtype by name, and the median of repeated timings.

use candle_core::DType;

/// The dtypes a chapter's parameters may name.
pub const DTYPES: [&str; 3] = ["f32", "f16", "bf16"];

/// The dtype a chapter names (one of [`DTYPES`]).
pub fn parse_dtype(name: &str) -> anyhow::Result<DType> {
    match name {
        "f32" => Ok(DType::F32),
        "f16" => Ok(DType::F16),
        "bf16" => Ok(DType::BF16),
        other => anyhow::bail!("unknown dtype `{other}`, expected one of `f32`, `f16`, `bf16`"),
    }
}

/// The median of `values`: the middle one, or the mean of the middle two;
/// NaN for none (a figure that was not measured, not a zero).
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_named_dtype_parses_and_others_are_named_in_the_error() {
        for name in DTYPES {
            assert_eq!(parse_dtype(name).unwrap().as_str(), name);
        }
        let err = parse_dtype("f8").unwrap_err().to_string();
        assert_eq!(
            err,
            "unknown dtype `f8`, expected one of `f32`, `f16`, `bf16`"
        );
    }

    #[test]
    fn the_median_of_odd_and_even_counts_and_of_none() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(vec![]).is_nan());
    }
}
