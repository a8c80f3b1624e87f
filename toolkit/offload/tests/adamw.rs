//! LeanAdamW (candle-lean-optim) and HostAdamW against candle_nn::AdamW,
//! their state files, the bytes HostAdamW moves, in every float dtype; here
//! because this crate depends on both.

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_lean_optim::LeanAdamW;
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use candle_offload::HostAdamW;

fn params() -> ParamsAdamW {
    ParamsAdamW {
        lr: 0.01,
        weight_decay: 0.05,
        ..Default::default()
    }
}

/// Three variables of different shapes, deterministic values.
fn vars(dtype: DType) -> Result<Vec<Var>> {
    let dev = Device::Cpu;
    [(4usize, 3usize), (3, 1), (7, 5)]
        .iter()
        .enumerate()
        .map(|(i, &(a, b))| {
            let n = a * b;
            let data: Vec<f32> = (0..n)
                .map(|j| ((i * 31 + j * 7) % 13) as f32 / 6.0 - 1.0)
                .collect();
            Var::from_tensor(&Tensor::from_vec(data, (a, b), &dev)?.to_dtype(dtype)?)
        })
        .collect()
}

/// A loss with a different gradient each step.
fn loss(vars: &[Var], step: usize) -> Result<Tensor> {
    let mut total: Option<Tensor> = None;
    for (i, v) in vars.iter().enumerate() {
        let t = ((v.as_tensor().to_dtype(DType::F32)? - (step + i) as f64 * 0.01)?
            .sqr()?
            .sum_all()?
            * (1.0 + i as f64))?;
        total = Some(match total {
            Some(s) => (s + t)?,
            None => t,
        });
    }
    Ok(total.expect("vars"))
}

fn max_diff(a: &[Var], b: &[Var]) -> Result<f64> {
    let mut worst = 0f64;
    for (x, y) in a.iter().zip(b) {
        let d = (x.as_tensor().to_dtype(DType::F64)? - y.as_tensor().to_dtype(DType::F64)?)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f64>()?;
        worst = worst.max(d);
    }
    Ok(worst)
}

fn run<O: Optimizer>(opt: &mut O, vars: &[Var], steps: std::ops::Range<usize>) -> Result<()> {
    for step in steps {
        opt.backward_step(&loss(vars, step)?)?;
    }
    Ok(())
}

#[test]
fn lean_equals_candle_adamw_over_100_steps() -> Result<()> {
    for dtype in [DType::F32, DType::F64] {
        let (a, b) = (vars(dtype)?, vars(dtype)?);
        run(&mut LeanAdamW::new(a.clone(), params())?, &a, 0..100)?;
        run(&mut AdamW::new(b.clone(), params())?, &b, 0..100)?;
        let d = max_diff(&a, &b)?;
        assert!(d <= 1e-7, "{dtype:?}: {d}");
    }
    Ok(())
}

#[test]
fn host_equals_candle_adamw_over_100_steps() -> Result<()> {
    let (a, b) = (vars(DType::F32)?, vars(DType::F32)?);
    run(&mut HostAdamW::new(a.clone(), params())?, &a, 0..100)?;
    run(&mut AdamW::new(b.clone(), params())?, &b, 0..100)?;
    assert!(max_diff(&a, &b)? <= 1e-7);
    Ok(())
}

/// Half-precision parameters: updated through f32 arithmetic (lean) or
/// from f32 masters (host), both close to an f32 run; candle's AdamW
/// rounds its constants to the parameter's dtype.
#[test]
fn half_precision_parameters_follow_the_f32_run() -> Result<()> {
    let reference = vars(DType::F32)?;
    run(
        &mut AdamW::new(reference.clone(), params())?,
        &reference,
        0..100,
    )?;
    for (dtype, tol) in [(DType::F16, 2e-2), (DType::BF16, 1e-1)] {
        let lean = vars(dtype)?;
        run(&mut LeanAdamW::new(lean.clone(), params())?, &lean, 0..100)?;
        let host = vars(dtype)?;
        run(&mut HostAdamW::new(host.clone(), params())?, &host, 0..100)?;
        for v in lean.iter().chain(&host) {
            assert_eq!(v.dtype(), dtype);
        }
        let candle = vars(dtype)?;
        run(&mut AdamW::new(candle.clone(), params())?, &candle, 0..100)?;
        let (dl, dh) = (max_diff(&lean, &reference)?, max_diff(&host, &reference)?);
        let dc = max_diff(&candle, &reference)?;
        println!("{dtype:?} after 100 steps, max |diff| from f32: lean {dl:.2e}, host {dh:.2e}, candle {dc:.2e}");
        assert!(dl < tol && dh < tol, "{dtype:?}: lean {dl}, host {dh}");
        // The masters keep the small updates that half parameters round
        // away: within the half type's own rounding of the f32 run.
        assert!(dh < dl / 4.0, "{dtype:?}: lean {dl}, host {dh}");
    }
    Ok(())
}

/// The old HostAdamW copied each parameter to the host as well: 3x the
/// parameter bytes per step. f32 masters on the host make it 2x.
#[test]
fn host_moves_twice_the_parameter_bytes_per_step() -> Result<()> {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let v = vars(dtype)?;
        let bytes: u64 = v
            .iter()
            .map(|v| (v.elem_count() * dtype.size_in_bytes()) as u64)
            .sum();
        let mut opt = HostAdamW::new(v.clone(), params())?;
        let before = opt.transfers();
        run(&mut opt, &v, 0..1)?;
        let step = opt.transfers().since(&before);
        assert_eq!(step.to_host_bytes, bytes, "{dtype:?}");
        assert_eq!(step.to_device_bytes, bytes, "{dtype:?}");
    }
    Ok(())
}

#[test]
fn saved_state_resumes_exactly() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("lean-optim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = (vars(DType::F32)?, vars(DType::F32)?);
    run(&mut LeanAdamW::new(a.clone(), params())?, &a, 0..60)?;
    let mut first = LeanAdamW::new(b.clone(), params())?;
    run(&mut first, &b, 0..30)?;
    first.save(dir.join("lean.safetensors"))?;
    let mut second = LeanAdamW::new(b.clone(), ParamsAdamW::default())?;
    second.load(dir.join("lean.safetensors"))?;
    assert_eq!(second.step_count(), 30);
    assert_eq!(second.params().lr, 0.01);
    run(&mut second, &b, 30..60)?;
    assert_eq!(max_diff(&a, &b)?, 0.0);

    let (c, d) = (vars(DType::F16)?, vars(DType::F16)?);
    run(&mut HostAdamW::new(c.clone(), params())?, &c, 0..20)?;
    let mut first = HostAdamW::new(d.clone(), params())?;
    run(&mut first, &d, 0..10)?;
    first.save(dir.join("host.safetensors"))?;
    let fresh = vars(DType::F16)?; // other weights: the masters restore them
    let mut second = HostAdamW::new(fresh.clone(), params())?;
    second.load(dir.join("host.safetensors"))?;
    run(&mut second, &fresh, 10..20)?;
    assert_eq!(max_diff(&c, &fresh)?, 0.0);

    // A state saved for other variables is refused, naming what differs.
    let other = vec![Var::zeros(2, DType::F32, &Device::Cpu)?];
    let e = LeanAdamW::new(other, params())?
        .load(dir.join("lean.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("saved m.0 has shape [4, 3], the variable [2]"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

/// Gradients received during a backward that then failed can be dropped,
/// so that they do not join the next step's.
#[test]
fn received_gradients_can_be_discarded() -> Result<()> {
    let (a, b) = (vars(DType::F32)?, vars(DType::F32)?);
    let mut host = HostAdamW::new(a.clone(), params())?;
    let mut reference = AdamW::new(b.clone(), params())?;
    let junk = Tensor::ones(a[0].shape(), DType::F32, &Device::Cpu)?;
    host.receive(&a[0], &junk)?;
    host.discard_received();
    let grads = loss(&a, 0)?.backward()?;
    for v in &a {
        host.receive(v, grads.get(v.as_tensor()).unwrap())?;
    }
    host.step_received()?;
    reference.backward_step(&loss(&b, 0)?)?;
    assert_eq!(max_diff(&a, &b)?, 0.0);
    Ok(())
}
