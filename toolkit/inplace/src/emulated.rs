//! The launches' plans (`plan.rs`) run through candle's own kernels on the
//! CPU: the sources of the candle-kernels that candle-core builds, compiled
//! with just enough of CUDA emulated (`candle-toolkit-cuda-emulation`) by
//! `tests/emulated/launch.h`, which passes each argument in the order of
//! the kernel's own parameters. The output, written over its operand, is
//! held to the bits of candle's operation on the CPU (the softmax, whose
//! sum the kernel takes in another order, to its rounding), and what lies
//! outside the output to what was there. Each runs race-checked as well:
//! an operand that is its output is read and written by one thread.
//!
//! The kernels are compiled as nvcc compiles them for sm_90, so that
//! candle's f16 and bf16 kernels (built from compute capability 5.3 and
//! 8.0 on) run beside its f32 and f64 ones: every dtype the launches take.
//! Where they are aligned, bf16's `badd` and `bmul` take candle's
//! vectorised path (eight elements to a 16-byte load), which the two
//! contiguous cases at offset 0 reach.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use candle_core::{DType, Device, Layout, Result, Tensor};
use candle_toolkit_cuda_emulation::{self as emulation, Build};

use crate::params::{self, name};
use crate::plan;

/// candle-kernels' files with the kernels each harness launches.
const FILES: [(&str, &[&str]); 4] = [
    ("binary", &[name::ADD, name::SUB, name::MUL]),
    ("unary", &[name::RELU]),
    ("affine", &[name::AFFINE]),
    ("reduce", &[name::SOFTMAX]),
];

/// Every dtype the launches take.
const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

/// The harness for candle-kernels' `file`.cu built as `build`, compiled
/// once per test process.
fn harness(file: &str, build: Build) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashMap<(String, Build), PathBuf>>> = OnceLock::new();
    let mut built = BUILT.get_or_init(Default::default).lock().unwrap();
    built
        .entry((file.to_string(), build))
        .or_insert_with(|| {
            let (_, kernels) = FILES.iter().find(|(f, _)| *f == file).expect("a file");
            let launches = kernels
                .iter()
                .flat_map(|k| DTYPES.map(|d| format!("K({k}_{})", d.as_str())))
                .collect::<Vec<_>>()
                .join(" ");
            // As nvcc compiles candle's kernels for sm_90: with their half
            // types' (params.rs's test reads the same declarations).
            let source = format!(
                "#define __CUDA_ARCH__ 900\n#include \"emulate.h\"\n#include \"{}\"\n\
                 #define CANDLE_KERNELS(K) {launches}\n#include \"{}\"\n",
                params::tests::candle_kernels_src()
                    .join(format!("{file}.cu"))
                    .display(),
                Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("tests/emulated/launch.h")
                    .display(),
            );
            // One path for each file, so that later runs find what this one
            // compiled.
            let dir = emulation::cache_dir().join("candle-inplace");
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join(format!("{file}.cpp"));
            if std::fs::read_to_string(&path).ok().as_deref() != Some(source.as_str()) {
                std::fs::write(&path, &source).unwrap();
            }
            emulation::compile_as(&path, build)
        })
        .clone()
}

/// A tensor's whole buffer, as f64s.
fn buffer(base: &Tensor) -> Vec<f64> {
    base.flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn bits(v: &[f64]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Launches `kernel` on the plan's grid with `buffers` (element type and
/// values) and `args` (one per parameter, `null`, `BUFFER+OFFSET` or a
/// number) in both builds, and returns every buffer afterwards.
fn launch(
    file: &str,
    kernel: &str,
    grid: plan::Grid,
    buffers: &[(&str, Vec<f64>)],
    args: &[String],
) -> Vec<Vec<f64>> {
    let spec = buffers
        .iter()
        .map(|(t, v)| format!("{t}:{}", v.len()))
        .collect::<Vec<_>>()
        .join(",");
    let mut argv = vec![
        kernel.to_string(),
        grid.blocks.to_string(),
        grid.threads.0.to_string(),
        grid.threads.1.to_string(),
        spec,
    ];
    argv.extend(args.iter().cloned());
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let input: Vec<f64> = buffers.iter().flat_map(|(_, v)| v.clone()).collect();
    let mut results = [Build::Plain, Build::RaceChecked]
        .map(|build| emulation::run_on_f64(&harness(file, build), &argv, &input));
    assert_eq!(
        bits(&results[0]),
        bits(&results[1]),
        "{kernel}: the race-checked build gave other values"
    );
    let mut flat = std::mem::take(&mut results[0]).into_iter();
    buffers
        .iter()
        .map(|(_, v)| flat.by_ref().take(v.len()).collect())
        .collect()
}

/// `out`'s buffer (whose elements the layout `ol` covers) after the launch,
/// against `want` in the layout's range and the buffer's own values
/// elsewhere.
fn assert_written(kernel: &str, got: &[f64], before: &[f64], out: (usize, usize), want: &[f64]) {
    assert_eq!(
        bits(&got[out.0..out.1]),
        bits(want),
        "{kernel}: the output's elements"
    );
    assert_eq!(
        bits(&got[..out.0]),
        bits(&before[..out.0]),
        "{kernel}: the buffer before the output"
    );
    assert_eq!(
        bits(&got[out.1..]),
        bits(&before[out.1..]),
        "{kernel}: the buffer after the output"
    );
}

fn randn(dims: &[usize], dtype: DType) -> Tensor {
    Tensor::randn(0f32, 1.0, dims, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// The output: `base`'s rows `start..start + len`, contiguous at an offset
/// into its buffer.
fn rows(base: &Tensor, start: usize, len: usize) -> Tensor {
    base.narrow(0, start, len).unwrap()
}

/// A layout of `out = out OP rhs`: what it is, the output's base and its
/// rows, rhs's base, and rhs from its base.
type Case = (
    &'static str,
    &'static [usize],
    (usize, usize),
    &'static [usize],
    fn(&Tensor) -> Tensor,
);

#[test]
fn out_op_rhs_gives_candles_bits_for_every_layout_of_rhs() -> Result<()> {
    for dtype in DTYPES {
        let t = dtype.as_str();
        let cases: [Case; 6] = [
            ("contiguous", &[4, 5], (0, 4), &[4, 5], |b| b.clone()),
            ("a broadcast row", &[4, 5], (0, 4), &[5], |b| {
                b.broadcast_as((4, 5)).unwrap()
            }),
            // Over 1,024 elements: two blocks.
            (
                "broadcast along the middle",
                &[3, 50, 7],
                (0, 3),
                &[3, 1, 7],
                |b| b.broadcast_as((3, 50, 7)).unwrap(),
            ),
            ("narrowed and transposed", &[9, 5], (0, 9), &[6, 9], |b| {
                b.narrow(0, 1, 5).unwrap().t().unwrap()
            }),
            ("an output at an offset", &[10, 5], (2, 6), &[6, 5], |b| {
                b.clone()
            }),
            // The product's turn on bf16's vectorised path.
            ("contiguous", &[4, 5], (0, 4), &[4, 5], |b| b.clone()),
        ];
        // One operation for each layout, in turn: they differ only in the
        // arithmetic, which the kernels write the same for each layout.
        for (i, (what, out_dims, (r0, rn), rhs_dims, make_rhs)) in cases.into_iter().enumerate() {
            let out_base = randn(out_dims, dtype);
            let out = rows(&out_base, r0, rn);
            let rhs_base = randn(rhs_dims, dtype);
            let rhs = make_rhs(&rhs_base);
            let plan = plan::binary(
                name::ADD,
                (out.layout(), out.dtype()),
                (rhs.layout(), rhs.dtype()),
            )?
            .expect("elements to write");
            let before = buffer(&out_base);
            let mut buffers = vec![(t, before.clone()), (t, buffer(&rhs_base))];
            let info = match &plan.dims_and_strides {
                None => "null".to_string(),
                Some(info) => {
                    buffers.push(("size_t", info.iter().map(|&x| x as f64).collect()));
                    "2+0".to_string()
                }
            };
            let (o0, o1) = plan.out;
            let args = [
                (o1 - o0).to_string(),
                plan.num_dims.to_string(),
                info,
                format!("0+{o0}"),
                format!("1+{}", plan.rhs_start),
                format!("0+{o0}"),
            ];
            let (kernel, want) = match i % 3 {
                0 => (name::ADD, (&out + &rhs)?),
                1 => (name::SUB, (&out - &rhs)?),
                _ => (name::MUL, (&out * &rhs)?),
            };
            let kernel = format!("{kernel}_{t}");
            let got = launch("binary", &kernel, plan.grid, &buffers, &args);
            let label = format!("{kernel}, {what}");
            assert_written(&label, &got[0], &before, plan.out, &buffer(&want));
            assert_eq!(bits(&got[1]), bits(&buffers[1].1), "{label}: rhs");
        }
    }
    Ok(())
}

#[test]
fn relu_and_scale_in_place_give_candles_bits() -> Result<()> {
    for dtype in DTYPES {
        let t = dtype.as_str();
        // 1,300 elements at an offset: two blocks.
        let base = randn(&[1500], dtype);
        let out = rows(&base, 100, 1300);
        let plan = plan::in_place(out.layout(), "relu")?.expect("elements to write");
        let before = buffer(&base);
        let (o0, o1) = plan.out;
        let common = [
            (o1 - o0).to_string(),
            "1".to_string(),
            "null".to_string(),
            "null".to_string(),
            format!("0+{o0}"),
        ];
        let buffers = [(t, before.clone())];
        let got = launch(
            "unary",
            &format!("{}_{t}", name::RELU),
            plan.grid,
            &buffers,
            &common,
        );
        assert_written("relu", &got[0], &before, plan.out, &buffer(&out.relu()?));

        let mul = 0.37;
        // `scale` passes `T::from_f64(mul)` and `T::from_f64(0.0)`: exact
        // here as f64s.
        let as_t = |x: f64| -> f64 {
            match dtype {
                DType::F32 => x as f32 as f64,
                DType::F16 => half::f16::from_f64(x).to_f64(),
                DType::BF16 => half::bf16::from_f64(x).to_f64(),
                _ => x,
            }
        };
        let mut args = common.to_vec();
        args.extend([format!("{:?}", as_t(mul)), "0".to_string()]);
        let got = launch(
            "affine",
            &format!("{}_{t}", name::AFFINE),
            plan.grid,
            &buffers,
            &args,
        );
        assert_written("scale", &got[0], &before, plan.out, &buffer(&(&out * mul)?));
    }
    Ok(())
}

#[test]
fn the_softmax_in_place_is_the_rows_softmax_to_its_rounding() -> Result<()> {
    for dtype in DTYPES {
        let t = dtype.as_str();
        // Fewer columns than a warp's lanes, and more (not a multiple).
        for cols in [5, 70] {
            let base = (randn(&[9, cols], dtype) * 4.0)?;
            let out = rows(&base, 1, 7);
            let plan = plan::softmax(out.layout())?.expect("elements to write");
            let before = buffer(&base);
            let (o0, o1) = plan.out;
            let args = [
                format!("0+{o0}"),
                format!("0+{o0}"),
                plan.n_cols.to_string(),
            ];
            let kernel = format!("{}_{t}", name::SOFTMAX);
            let got = launch("reduce", &kernel, plan.grid, &[(t, before.clone())], &args);
            let got = &got[0];
            assert_eq!(bits(&got[..o0]), bits(&before[..o0]), "{kernel}: before");
            assert_eq!(bits(&got[o1..]), bits(&before[o1..]), "{kernel}: after");
            // Each lane sums its columns in turn, then five steps of a
            // butterfly; then exp's, the reciprocal's and the product's
            // roundings, and `x - max`'s, which exp turns into a relative
            // error of up to |x - max| / 2 units. A half type computes
            // `x - max`, exp and the product in the type (the reciprocal
            // rounded to it first) and sums in f32,
            // within the same units of its own; an exp that falls among
            // its subnormals (f16's below 6e-5) is off by up to one of
            // their spacing, `tiny`.
            let (eps, tiny) = match dtype {
                DType::F32 => (f32::EPSILON as f64, 0.0),
                DType::F16 => (half::f16::EPSILON.to_f64(), 2f64.powi(-24)),
                DType::BF16 => (half::bf16::EPSILON.to_f64(), 2f64.powi(-133)),
                _ => (f64::EPSILON, 0.0),
            };
            let sum_steps = (cols.div_ceil(32) + 5 + 3) as f64;
            for (r, row) in before[o0..o1].chunks(cols).enumerate() {
                let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = row.iter().map(|x| (x - max).exp()).sum();
                for (c, x) in row.iter().enumerate() {
                    let want = (x - max).exp() / sum;
                    let bound = (sum_steps + (x - max).abs() / 2.0) * eps;
                    let at = o0 + r * cols + c;
                    assert!(
                        (got[at] - want).abs() <= bound * want + tiny,
                        "{kernel}, {cols} columns: row {r} column {c}: {} for {want}",
                        got[at]
                    );
                }
            }
        }
    }
    Ok(())
}

/// The plans' layouts that the launches refuse.
#[test]
fn a_plan_refuses_what_the_kernels_cannot_write_in_place() {
    fn err<T>(r: Result<T>) -> String {
        match r {
            Ok(_) => panic!("accepted"),
            // The message, without a backtrace that RUST_BACKTRACE adds.
            Err(e) => e.to_string().lines().next().unwrap_or_default().to_string(),
        }
    }
    let out = Tensor::zeros((4, 5), DType::F32, &Device::Cpu).unwrap();
    let t = out.t().unwrap();
    assert_eq!(
        err(plan::in_place(t.layout(), "relu")),
        "relu in place: the output must be contiguous"
    );
    let small = Tensor::zeros(5, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(
        err(plan::binary(
            "badd",
            (out.layout(), DType::F32),
            (small.layout(), DType::F32)
        )),
        "badd in place: an operand of shape [5] for an output of shape [4, 5]"
    );
    assert_eq!(
        err(plan::binary(
            "badd",
            (out.layout(), DType::F32),
            (out.layout(), DType::F16)
        )),
        "badd in place: a F16 operand for a F32 output"
    );
    let huge = Layout::contiguous(plan::MAX_ELEMENTS + 1);
    assert_eq!(
        err(plan::softmax(&huge)),
        format!(
            "softmax in place: at most 2^30 elements at once on a GPU, not {}",
            plan::MAX_ELEMENTS + 1
        )
    );
    let empty = Layout::contiguous((3, 0));
    assert!(plan::softmax(&empty).unwrap().is_none());
}
