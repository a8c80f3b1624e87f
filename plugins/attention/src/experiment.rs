//! The attention cell's experiment: what `workbook run` executes and what
//! the chapter's notebook shows in its code cells (see
//! `workbook_sdk::notebook`). Crates are named by their names, this one's
//! included, so that the same text compiles in a notebook cell.

use candle_tiled_attention::{
    flash_forward, materialized_forward, naive_attention, score_matrix_bytes, FlashConfig,
};
use workbook_attention::Params as AttentionParams;
use workbook_models::{max_abs_diff, Rng};
use workbook_sdk::anyhow;
use workbook_sdk::candle::{DType, Device, Result, Tensor, Var};
use workbook_sdk::output::{Axis, Guide, Series, Unit};
use workbook_sdk::timing::{timed, Timed};
use workbook_sdk::{Category, Context, Figure, Table};

// notebook cell
/// The four ways attention is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// The whole score matrix, through candle's composed operations.
    Naive,
    /// The same, keeping only the probabilities for the backward.
    Materialized,
    /// Tiled with the key block as long as the sequence.
    Chunked,
    /// Tiled, recomputing each probability block in the backward.
    Tiled,
}

impl Method {
    /// Its name in tables and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Method::Naive => "naive",
            Method::Materialized => "materialized",
            Method::Chunked => "chunked",
            Method::Tiled => "tiled",
        }
    }
}

/// Queries, keys, values and the gradient arriving at the output.
pub struct Qkv {
    /// Queries.
    pub q: Tensor,
    /// Keys.
    pub k: Tensor,
    /// Values.
    pub v: Tensor,
    /// The output's gradient.
    pub d_out: Tensor,
}

/// Random inputs of `batch` heads of `n` tokens of width `d`.
pub fn qkv(rng: &mut Rng, batch: usize, n: usize, d: usize, device: &Device) -> Result<Qkv> {
    let _inputs = Category::Inputs.enter();
    Ok(Qkv {
        q: rng.randn((1, batch, n, d), device)?,
        k: rng.randn((1, batch, n, d), device)?,
        v: rng.randn((1, batch, n, d), device)?,
        d_out: rng.randn((1, batch, n, d), device)?,
    })
}

/// Forward and backward of one method: (out, dq, dk, dv). `after_forward`
/// runs between the two (to mark a timeline).
pub fn forward_backward(
    m: Method,
    x: &Qkv,
    causal: bool,
    p: &AttentionParams,
    mut after_forward: impl FnMut(),
) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    match m {
        Method::Naive => {
            let (q, k, v) = (
                Var::from_tensor(&x.q)?,
                Var::from_tensor(&x.k)?,
                Var::from_tensor(&x.v)?,
            );
            let cfg = FlashConfig::causal(causal);
            let out = Category::Activations.scope(|| naive_attention(&q, &k, &v, &cfg))?;
            after_forward();
            let grads = Category::Gradients.scope(|| (&out * &x.d_out)?.sum_all()?.backward())?;
            let get = |t: &Var| {
                grads
                    .get(t.as_tensor())
                    .map(|g| g.detach())
                    .ok_or_else(|| workbook_sdk::candle::Error::Msg("missing gradient".into()))
            };
            Ok((out.detach(), get(&q)?, get(&k)?, get(&v)?))
        }
        Method::Materialized => {
            let cfg = FlashConfig::causal(causal);
            let fwd =
                Category::Activations.scope(|| materialized_forward(&x.q, &x.k, &x.v, &cfg))?;
            let out = fwd.out.clone();
            after_forward();
            let (dq, dk, dv) =
                Category::Gradients.scope(|| fwd.backward(&x.q, &x.k, &x.v, &x.d_out))?;
            Ok((out, dq, dk, dv))
        }
        Method::Chunked | Method::Tiled => {
            let cfg = FlashConfig {
                causal,
                q_block: p.q_block,
                k_block: if m == Method::Chunked {
                    x.k.dim(2)?
                } else {
                    p.k_block
                },
                scale: None,
            };
            let fwd = Category::Activations.scope(|| flash_forward(&x.q, &x.k, &x.v, &cfg))?;
            after_forward();
            let (dq, dk, dv) =
                Category::Gradients.scope(|| fwd.backward(&x.q, &x.k, &x.v, &x.d_out))?;
            Ok((fwd.out, dq, dk, dv))
        }
    }
}

/// The methods in the order of the sweep's table, series and metrics.
pub const METHODS: [Method; 4] = [
    Method::Naive,
    Method::Materialized,
    Method::Chunked,
    Method::Tiled,
];

// notebook cell
/// The tiled attention in f16 and bf16 (f32 accumulation inside) against
/// the f32 reference `reference` (out, dq, dk, dv) on the same inputs.
pub fn half_precision_diffs(
    ctx: &mut Context,
    p: &AttentionParams,
    x: &Qkv,
    reference: &(Tensor, Tensor, Tensor, Tensor),
) -> Result<()> {
    let (o, dq, dk, dv) = reference;
    for (dtype, name) in [(DType::F16, "f16"), (DType::BF16, "bf16")] {
        let cast = |t: &Tensor| t.to_dtype(dtype);
        let cfg = FlashConfig {
            causal: true,
            q_block: p.q_block,
            k_block: p.k_block,
            scale: None,
        };
        let (q, k, v) = (cast(&x.q)?, cast(&x.k)?, cast(&x.v)?);
        let fwd = flash_forward(&q, &k, &v, &cfg)?;
        let (dq2, dk2, dv2) = fwd.backward(&q, &k, &v, &cast(&x.d_out)?)?;
        ctx.metric(
            format!("out_diff_tiled_causal_{name}"),
            max_abs_diff(o, &fwd.out)?,
        );
        let grad = max_abs_diff(dq, &dq2)?
            .max(max_abs_diff(dk, &dk2)?)
            .max(max_abs_diff(dv, &dv2)?);
        ctx.metric(format!("grad_diff_tiled_causal_{name}"), grad);
    }
    Ok(())
}

/// Every method's output and gradients against the naive reference's,
/// with and without the causal mask, at the check length.
pub fn equal_to_naive(ctx: &mut Context, p: &AttentionParams, rng: &mut Rng) -> Result<()> {
    let device = ctx.device().clone();
    let x = qkv(rng, p.heads, p.check_length, p.head_dim, &device)?;
    for causal in [false, true] {
        let reference = forward_backward(Method::Naive, &x, causal, p, || {})?;
        let (o, dq, dk, dv) = &reference;
        for m in [Method::Materialized, Method::Chunked, Method::Tiled] {
            let (o2, dq2, dk2, dv2) = forward_backward(m, &x, causal, p, || {})?;
            let tag = format!("{}{}", m.name(), if causal { "_causal" } else { "" });
            ctx.metric(format!("out_diff_{tag}"), max_abs_diff(o, &o2)?);
            let grad = max_abs_diff(dq, &dq2)?
                .max(max_abs_diff(dk, &dk2)?)
                .max(max_abs_diff(dv, &dv2)?);
            ctx.metric(format!("grad_diff_{tag}"), grad);
        }
        if causal {
            half_precision_diffs(ctx, p, &x, &reference)?;
        }
    }
    Ok(())
}

/// Each method's points over the sweep, in [`METHODS`]' order: (N, peak
/// bytes), (N, best wall seconds), (N, best CPU seconds).
pub struct LengthSweep {
    /// Peak bytes above the region's start.
    pub peaks: Vec<Vec<(f64, f64)>>,
    /// The best run's wall time.
    pub times: Vec<Vec<(f64, f64)>>,
    /// The best run's CPU time.
    pub cpu_times: Vec<Vec<(f64, f64)>>,
}

// notebook cell
/// One sequence length: every method's forward and backward `p.repeats`
/// times, the methods taking turns within each repetition so that load
/// from elsewhere on the machine falls on all of them alike. Each
/// method's peak (from its first run) and its runs' times.
pub fn one_length(
    ctx: &mut Context,
    p: &AttentionParams,
    x: &Qkv,
    n: usize,
) -> Result<(Vec<u64>, Vec<Vec<Timed>>)> {
    let mut ts = vec![Vec::new(); METHODS.len()];
    let mut region_peaks = vec![0u64; METHODS.len()];
    for rep in 0..p.repeats {
        for (i, &m) in METHODS.iter().enumerate() {
            ctx.progress(&format!("{} attention, N = {n}, run {}", m.name(), rep + 1));
            let mut region = ctx.region(format!("{}, N = {n}", m.name()));
            let (out, t) = timed(|| -> Result<_> {
                let out = forward_backward(m, x, false, p, || region.mark("after forward"))?;
                // On a GPU the backward's last kernels may still be running.
                x.q.device().synchronize()?;
                Ok(out)
            });
            ts[i].push(t);
            let out = out?;
            region.mark("after backward");
            drop(out);
            if rep == 0 {
                region_peaks[i] = ctx.end_region(region).peak_above_baseline();
            }
        }
    }
    Ok((region_peaks, ts))
}

/// The sweep over sequence length, as a table of each method's peak and
/// best times (the best of the repetitions).
pub fn length_sweep(ctx: &mut Context, p: &AttentionParams, rng: &mut Rng) -> Result<LengthSweep> {
    let device = ctx.device().clone();
    let mut table = Table::new(
        format!(
            "Forward + backward, {} heads x {} dims, blocks {} x {}",
            p.heads, p.head_dim, p.q_block, p.k_block
        ),
        &[
            ("N", Unit::Count),
            ("naive peak", Unit::Bytes),
            ("materialized peak", Unit::Bytes),
            ("chunked peak", Unit::Bytes),
            ("tiled peak", Unit::Bytes),
            ("naive wall", Unit::Seconds),
            ("naive CPU", Unit::Seconds),
            ("materialized wall", Unit::Seconds),
            ("materialized CPU", Unit::Seconds),
            ("chunked wall", Unit::Seconds),
            ("chunked CPU", Unit::Seconds),
            ("tiled wall", Unit::Seconds),
            ("tiled CPU", Unit::Seconds),
        ],
    );
    let points = || vec![Vec::new(); METHODS.len()];
    let mut out = LengthSweep {
        peaks: points(),
        times: points(),
        cpu_times: points(),
    };
    for &n in &p.lengths {
        let x = qkv(rng, p.heads, n, p.head_dim, &device)?;
        let (region_peaks, ts) = one_length(ctx, p, &x, n)?;
        let mut row: Vec<workbook_sdk::serde_json::Value> = vec![n.into()];
        let mut row_times = Vec::new();
        for i in 0..METHODS.len() {
            let best = |f: fn(&Timed) -> f64| ts[i].iter().map(f).fold(f64::INFINITY, f64::min);
            let (wall, cpu) = (best(|t| t.wall), best(|t| t.cpu));
            out.peaks[i].push((n as f64, region_peaks[i] as f64));
            out.times[i].push((n as f64, wall));
            out.cpu_times[i].push((n as f64, cpu));
            row.push(region_peaks[i].into());
            row_times.push(wall);
            row_times.push(cpu);
        }
        row.extend(
            row_times
                .into_iter()
                .map(workbook_sdk::serde_json::Value::from),
        );
        table.row(row);
    }
    ctx.table(table);
    Ok(out)
}

// notebook cell
/// The sweep's longest sequence summed up: each method's peak and time,
/// how its peak grows with N, and the ratios between the methods.
pub fn attention_summary(ctx: &mut Context, p: &AttentionParams, s: &LengthSweep) {
    let last = |v: &Vec<(f64, f64)>| v.last().map_or(f64::NAN, |p| p.1);
    let first = |v: &Vec<(f64, f64)>| v.first().map_or(f64::NAN, |p| p.1);
    let (n0, n1) = (
        p.lengths.first().copied().unwrap_or(1) as f64,
        p.lengths.last().copied().unwrap_or(1) as f64,
    );
    // Growth exponent between the shortest and longest N: 2 for N^2, 1 for N.
    let exponent = |v: &Vec<(f64, f64)>| (last(v) / first(v)).ln() / (n1 / n0).ln();
    for (i, m) in METHODS.iter().enumerate() {
        ctx.metric(format!("peak_{}", m.name()), last(&s.peaks[i]));
        ctx.metric(format!("time_{}", m.name()), last(&s.times[i]));
        // One length has no growth to measure: 0 / 0 is no exponent.
        if n1 != n0 {
            ctx.metric(format!("growth_{}", m.name()), exponent(&s.peaks[i]));
        }
    }
    if n1 == n0 {
        ctx.print(format!(
            "no growth_* metrics: the sweep's first and last lengths are both {n0}, and how a \
             peak grows with N needs two"
        ));
    }
    let at = |m: Method| METHODS.iter().position(|&x| x == m).unwrap_or(0);
    let peak = |m: Method| last(&s.peaks[at(m)]);
    let time = |m: Method| last(&s.times[at(m)]);
    let cpu_time = |m: Method| last(&s.cpu_times[at(m)]);
    use Method::{Chunked, Materialized, Naive, Tiled};
    ctx.metric("peak_ratio_naive_tiled", peak(Naive) / peak(Tiled));
    ctx.metric(
        "peak_ratio_materialized_tiled",
        peak(Materialized) / peak(Tiled),
    );
    ctx.metric(
        "peak_ratio_naive_materialized",
        peak(Naive) / peak(Materialized),
    );
    // Naive's peak in units of one f32 score matrix for all heads.
    let matrix = (p.heads as f64) * n1 * n1 * 4.0;
    ctx.metric("naive_peak_in_score_matrices", peak(Naive) / matrix);
    ctx.metric(
        "materialized_peak_in_score_matrices",
        peak(Materialized) / matrix,
    );
    ctx.metric("time_ratio_tiled_naive", time(Tiled) / time(Naive));
    ctx.metric(
        "time_ratio_tiled_materialized",
        time(Tiled) / time(Materialized),
    );
    ctx.metric(
        "cpu_time_ratio_tiled_naive",
        cpu_time(Tiled) / cpu_time(Naive),
    );
    ctx.metric("largest_n", n1);
    ctx.print(format!(
        "at N = {n1}: naive {:.1} MiB, materialized {:.1} MiB, chunked {:.1} MiB, tiled {:.1} MiB ({:.0}x less than materialized, {:.0}x less than naive); tiled takes {:.2}x materialized's wall time, {:.2}x naive's",
        peak(Naive) / 1_048_576.0,
        peak(Materialized) / 1_048_576.0,
        peak(Chunked) / 1_048_576.0,
        peak(Tiled) / 1_048_576.0,
        peak(Materialized) / peak(Tiled),
        peak(Naive) / peak(Tiled),
        time(Tiled) / time(Materialized),
        time(Tiled) / time(Naive),
    ));
    let gb = score_matrix_bytes(32, 4096, DType::F16) as f64 / 1e9;
    ctx.print(format!(
        "one 4096 x 4096 score matrix for 32 heads in f16: {gb:.2} GB"
    ));
    ctx.metric("scores_32h_4096_f16_gb", gb);
}

/// The sweep's peaks and times against N, on log axes with N and N^2
/// guides.
pub fn attention_figures(ctx: &mut Context, s: &LengthSweep) {
    let series = |v: &[Vec<(f64, f64)>]| -> Vec<Series> {
        METHODS
            .iter()
            .zip(v)
            .map(|(m, pts)| Series {
                name: m.name().into(),
                points: pts.clone(),
            })
            .collect()
    };
    let guides = || {
        vec![
            Guide {
                power: 1.0,
                label: "grows as N".into(),
            },
            Guide {
                power: 2.0,
                label: "grows as N^2".into(),
            },
        ]
    };
    let axis = |label: &str, unit| Axis {
        label: label.into(),
        unit,
        log: true,
    };
    ctx.figure(Figure {
        id: "attention-peak".into(),
        title: "Attention peak memory against sequence length".into(),
        x: axis("sequence length N", Unit::Count),
        y: axis("peak memory", Unit::Bytes),
        series: series(&s.peaks),
        markers: Vec::new(),
        guides: guides(),
    });
    ctx.figure(Figure {
        id: "attention-time".into(),
        title: "Attention time against sequence length".into(),
        x: axis("sequence length N", Unit::Count),
        y: axis("forward + backward wall time, best run", Unit::Seconds),
        series: series(&s.times),
        markers: Vec::new(),
        guides: guides(),
    });
}

// notebook cell
/// The experiment: each method's forward and backward at every sequence
/// length, checked against the naive one, its peak beside the score
/// matrix's bytes, and its time.
pub fn attention_experiment(ctx: &mut Context, p: AttentionParams) -> anyhow::Result<()> {
    anyhow::ensure!(
        p.q_block > 0 && p.k_block > 0,
        "q_block and k_block must be at least 1"
    );
    anyhow::ensure!(p.repeats > 0, "repeats must be at least 1");
    let mut rng = Rng::seeded(p.seed);
    equal_to_naive(ctx, &p, &mut rng)?;
    let sweep = length_sweep(ctx, &p, &mut rng)?;
    attention_summary(ctx, &p, &sweep);
    attention_figures(ctx, &sweep);
    Ok(())
}
