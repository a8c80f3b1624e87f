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
        e.starts_with(&format!(
            "{}: its m.0 has shape [4, 3], this optimizer's [2]: was it saved for the same \
             variables?",
            dir.join("lean.safetensors").display()
        )),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

/// The first two of [`vars`]' shapes, and a third of another: a state
/// saved for [`vars`] matches these for two variables, then not.
fn two_of_three(dtype: DType) -> Result<Vec<Var>> {
    let mut v = vars(dtype)?;
    v[2] = Var::zeros((5, 7), dtype, &Device::Cpu)?;
    Ok(v)
}

/// A state file that does not match is refused before anything is
/// restored: the optimizer that refused it steps on exactly as its twin
/// that never tried. A step count that is not one is refused too.
#[test]
fn a_refused_state_file_changes_nothing() -> Result<()> {
    let dir = tempfile_dir("refused");
    let saved = vars(DType::F32)?;
    let mut opt = LeanAdamW::new(saved.clone(), params())?;
    run(&mut opt, &saved, 0..5)?;
    opt.save(dir.join("lean.safetensors"))?;
    let mut opt = HostAdamW::new(saved.clone(), params())?;
    run(&mut opt, &saved, 0..5)?;
    opt.save(dir.join("host.safetensors"))?;

    let (a, b) = (two_of_three(DType::F32)?, two_of_three(DType::F32)?);
    let (mut tried, mut twin) = (
        LeanAdamW::new(a.clone(), params())?,
        LeanAdamW::new(b.clone(), params())?,
    );
    run(&mut tried, &a, 0..3)?;
    run(&mut twin, &b, 0..3)?;
    let e = tried.load(dir.join("lean.safetensors")).unwrap_err();
    assert!(
        e.to_string().starts_with(&format!(
            "{}: its m.2 has shape [7, 5], this optimizer's [5, 7]",
            dir.join("lean.safetensors").display()
        )),
        "{e}"
    );
    assert_eq!(tried.step_count(), 3);
    run(&mut tried, &a, 3..6)?;
    run(&mut twin, &b, 3..6)?;
    assert_eq!(max_diff(&a, &b)?, 0.0);

    let (a, b) = (two_of_three(DType::F16)?, two_of_three(DType::F16)?);
    let (mut tried, mut twin) = (
        HostAdamW::new(a.clone(), params())?,
        HostAdamW::new(b.clone(), params())?,
    );
    run(&mut tried, &a, 0..3)?;
    run(&mut twin, &b, 0..3)?;
    let e = tried.load(dir.join("host.safetensors")).unwrap_err();
    assert!(
        e.to_string().starts_with(&format!(
            "{}: its master.2 has shape [7, 5], this optimizer's [5, 7]",
            dir.join("host.safetensors").display()
        )),
        "{e}"
    );
    run(&mut tried, &a, 3..6)?;
    run(&mut twin, &b, 3..6)?;
    assert_eq!(max_diff(&a, &b)?, 0.0);

    // Saved for more variables than the optimizer has.
    let e = LeanAdamW::new(vars(DType::F32)?[..2].to_vec(), params())?
        .load(dir.join("lean.safetensors"))
        .unwrap_err();
    assert!(
        e.to_string().starts_with(&format!(
            "{} has 6 tensors, 4 expected: it was saved for more variables than this \
                 optimizer has",
            dir.join("lean.safetensors").display()
        )),
        "{e}"
    );

    // A step count that is not a whole number from 0.
    for bad in [-1.0, 2.5, f64::NAN, 1e300] {
        let mut map: std::collections::HashMap<String, Tensor> =
            candle_core::safetensors::load(dir.join("lean.safetensors"), &Device::Cpu)?;
        map.insert("step".into(), Tensor::new(&[bad], &Device::Cpu)?);
        let file = dir.join("bad-step.safetensors");
        candle_core::safetensors::save(&map, &file)?;
        let e = LeanAdamW::new(vars(DType::F32)?, params())?
            .load(&file)
            .unwrap_err();
        assert!(
            e.to_string().starts_with(&format!(
                "{}: the saved step is {bad}; a step count is a whole number from 0 to 2^53",
                file.display()
            )),
            "{e}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

/// A fresh folder for one test's files.
fn tempfile_dir(test: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("adamw-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
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
