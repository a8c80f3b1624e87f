//! The inf check over every float dtype: an inf, a NaN or a -inf in any
//! tensor added is found, huge finite values are not, and an empty check
//! says so instead of answering false.

use candle_amp::InfCheck;
use candle_core::{DType, Device, Result, Tensor};

fn found(dtype: DType, tensors: &[&[f32]]) -> Result<Option<bool>> {
    let mut check = InfCheck::default();
    for values in tensors {
        check.add(&Tensor::new(*values, &Device::Cpu)?.to_dtype(dtype)?)?;
    }
    check.found()
}

const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::BF16, DType::F16];

#[test]
fn finite_values_are_not_found() -> Result<()> {
    for dtype in DTYPES {
        // The dtype's largest finite value, twice: summed as themselves
        // they would overflow to inf; times zero each is 0.
        let max = match dtype {
            DType::F16 => 65504.0,
            DType::BF16 => 3.3895314e38,
            _ => f32::MAX,
        };
        let got = found(dtype, &[&[1.0, -2.0, max, max], &[-max, 0.0]])?;
        assert_eq!(got, Some(false), "{dtype:?}");
    }
    Ok(())
}

#[test]
fn an_inf_or_nan_in_any_tensor_is_found() -> Result<()> {
    for dtype in DTYPES {
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let got = found(dtype, &[&[1.0, 2.0], &[3.0, bad, 4.0], &[5.0]])?;
            assert_eq!(got, Some(true), "{dtype:?} {bad}");
            let got = found(dtype, &[&[bad]])?;
            assert_eq!(got, Some(true), "{dtype:?} {bad} alone");
        }
        // An inf in one tensor and a -inf in another.
        let got = found(dtype, &[&[f32::INFINITY], &[f32::NEG_INFINITY]])?;
        assert_eq!(got, Some(true), "{dtype:?} inf and -inf");
    }
    Ok(())
}

#[test]
fn an_empty_check_is_none() -> Result<()> {
    assert_eq!(InfCheck::default().found()?, None);
    Ok(())
}
