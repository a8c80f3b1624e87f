//! The attention cell: scaled dot-product attention three ways, with a
//! backward that never holds the N x N score matrix.
//!
//! * [`naive_attention`]: `softmax(Q K^T / sqrt(d)) V`, the whole score matrix
//!   materialised; differentiable through candle's autograd. The reference.
//! * [`chunked_attention`]: the same, one block of queries at a time against
//!   all keys (the memory-efficient attention of the tutorials).
//! * [`tiled_attention`]: blocks of queries against blocks of keys, with an
//!   online softmax: a running maximum and sum per row, so no row of scores is
//!   ever whole (the FlashAttention idea).
//!
//! The memory-efficient versions save only their output and the log-sum-exp
//! of each row's scores. [`attention_backward`] recomputes each block of
//! probabilities from those, as FlashAttention-2 does:
//!
//! ```text
//! P  = exp(Q K^T * s - L)         (one block)
//! dV += P^T dO
//! dP = dO V^T
//! dS = P * (dP - rowsum(dO * O))
//! dQ += dS K * s,   dK += dS^T Q * s
//! ```
//!
//! Tensors are `(batch, seq, dim)`; fold heads into the batch.
#![warn(missing_docs)]

use serde::{Deserialize, Serialize};
use workbook_sdk::anyhow;
use workbook_sdk::candle::{DType, Device, Result, Tensor, Var, D};
use workbook_sdk::output::{Axis, Guide, Series, Unit};
use workbook_sdk::timing::{timed, Timed};
use workbook_sdk::train::{max_abs_diff, Rng};
use workbook_sdk::{Category, Context, Figure, Plugin, Rules, Table, Violation};

fn scale(q: &Tensor) -> Result<f64> {
    Ok(1.0 / (q.dim(D::Minus1)? as f64).sqrt())
}

/// A `(rows, cols)` f32 mask: 0 where key `ks + j` may be seen from query
/// `qs + i` (`j <= i` in absolute positions), minus infinity elsewhere.
fn causal_mask(qs: usize, rows: usize, ks: usize, cols: usize, device: &Device) -> Result<Tensor> {
    let data: Vec<f32> = (0..rows)
        .flat_map(|i| {
            (0..cols).map(move |j| {
                if ks + j <= qs + i {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Tensor::from_vec(data, (rows, cols), device)
}

/// Scores of a block, scaled and masked: `(batch, rows, cols)`.
fn block_scores(
    q: &Tensor,
    k: &Tensor,
    qs: usize,
    ks: usize,
    causal: bool,
    s: f64,
) -> Result<Tensor> {
    let scores = (q.matmul(&k.transpose(1, 2)?.contiguous()?)? * s)?;
    if causal && ks + k.dim(1)? > qs + 1 {
        let mask = causal_mask(qs, q.dim(1)?, ks, k.dim(1)?, q.device())?;
        scores.broadcast_add(&mask)
    } else {
        Ok(scores)
    }
}

/// Attention with the whole `(batch, n, n)` score matrix: the reference.
/// Differentiable through candle's autograd.
pub fn naive_attention(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<Tensor> {
    let scores = block_scores(q, k, 0, 0, causal, scale(q)?)?;
    let p = workbook_sdk::candle_nn::ops::softmax(&scores, D::Minus1)?;
    p.matmul(v)
}

/// What the memory-efficient forwards return: the output and, per row, the
/// log-sum-exp of its scores, which is all the backward needs.
#[derive(Debug, Clone)]
pub struct Attention {
    /// `(batch, n, dim)`.
    pub out: Tensor,
    /// `(batch, n, 1)`.
    pub lse: Tensor,
}

/// Attention one block of `chunk` queries at a time against all keys; only a
/// `(batch, chunk, n)` block of scores exists at once. No autograd graph is
/// kept: use [`attention_backward`] for gradients.
pub fn chunked_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    chunk: usize,
) -> Result<Attention> {
    let (q, k, v) = (q.detach(), k.detach(), v.detach());
    let (n, s) = (q.dim(1)?, scale(&q)?);
    let mut outs = Vec::new();
    let mut lses = Vec::new();
    for qs in (0..n).step_by(chunk.max(1)) {
        let rows = chunk.min(n - qs);
        let qb = q.narrow(1, qs, rows)?;
        // Keys past the last query of the block are all masked: skip them.
        let cols = if causal { qs + rows } else { n };
        let scores = block_scores(&qb, &k.narrow(1, 0, cols)?, qs, 0, causal, s)?;
        let m = scores.max_keepdim(D::Minus1)?;
        let e = scores.broadcast_sub(&m)?.exp()?;
        let sum = e.sum_keepdim(D::Minus1)?;
        outs.push(e.matmul(&v.narrow(1, 0, cols)?)?.broadcast_div(&sum)?);
        lses.push((m + sum.log()?)?);
    }
    Ok(Attention {
        out: Tensor::cat(&outs, 1)?,
        lse: Tensor::cat(&lses, 1)?,
    })
}

/// Attention by `(q_block x k_block)` tiles with an online softmax: per row a
/// running maximum `m`, sum `l` and output accumulator, rescaled as each key
/// block arrives. No autograd graph is kept: use [`attention_backward`].
pub fn tiled_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    q_block: usize,
    k_block: usize,
) -> Result<Attention> {
    let (q, k, v) = (q.detach(), k.detach(), v.detach());
    let (n, s) = (q.dim(1)?, scale(&q)?);
    let mut outs = Vec::new();
    let mut lses = Vec::new();
    for qs in (0..n).step_by(q_block.max(1)) {
        let rows = q_block.min(n - qs);
        let qb = q.narrow(1, qs, rows)?;
        let mut m: Option<Tensor> = None;
        let mut l: Option<Tensor> = None;
        let mut acc: Option<Tensor> = None;
        let k_end = if causal { qs + rows } else { n };
        for ks in (0..k_end).step_by(k_block.max(1)) {
            let cols = k_block.min(k_end - ks);
            let scores = block_scores(&qb, &k.narrow(1, ks, cols)?, qs, ks, causal, s)?;
            let block_max = scores.max_keepdim(D::Minus1)?;
            let new_m = match &m {
                Some(m) => m.maximum(&block_max)?,
                None => block_max,
            };
            let p = scores.broadcast_sub(&new_m)?.exp()?;
            let pv = p.matmul(&v.narrow(1, ks, cols)?)?;
            let p_sum = p.sum_keepdim(D::Minus1)?;
            (l, acc) = match (l, acc, &m) {
                (Some(l), Some(acc), Some(old_m)) => {
                    // Earlier blocks were exponentiated against the old maximum.
                    let correction = (old_m - &new_m)?.exp()?;
                    (
                        Some((l * &correction)?.add(&p_sum)?),
                        Some(acc.broadcast_mul(&correction)?.add(&pv)?),
                    )
                }
                _ => (Some(p_sum), Some(pv)),
            };
            m = Some(new_m);
        }
        let (m, l, acc) = match (m, l, acc) {
            (Some(m), Some(l), Some(acc)) => (m, l, acc),
            _ => workbook_sdk::candle::bail!("empty key range for queries {qs}.."),
        };
        outs.push(acc.broadcast_div(&l)?);
        lses.push((m + l.log()?)?);
    }
    Ok(Attention {
        out: Tensor::cat(&outs, 1)?,
        lse: Tensor::cat(&lses, 1)?,
    })
}

/// Gradients of attention with respect to `q`, `k` and `v`, given the
/// output gradient `d_out`, recomputing each `(q_block x k_block)` block of
/// probabilities from the saved log-sum-exp. Holds one block of scores at a
/// time, never the whole matrix.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    fwd: &Attention,
    d_out: &Tensor,
    causal: bool,
    q_block: usize,
    k_block: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (q, k, v, d_out) = (q.detach(), k.detach(), v.detach(), d_out.detach());
    let (n, s) = (q.dim(1)?, scale(&q)?);
    // rowsum(dO * O): the softmax backward's correction term, (batch, n, 1).
    let delta = (&d_out * &fwd.out)?.sum_keepdim(D::Minus1)?;
    let q_starts: Vec<usize> = (0..n).step_by(q_block.max(1)).collect();
    let mut dqs: Vec<Option<Tensor>> = vec![None; q_starts.len()];
    let mut dks = Vec::new();
    let mut dvs = Vec::new();
    // Outer loop over key blocks, as FlashAttention-2: dK and dV of a block
    // are finished before the next, dQ is summed block by block.
    for ks in (0..n).step_by(k_block.max(1)) {
        let cols = k_block.min(n - ks);
        let kb = k.narrow(1, ks, cols)?;
        let vb = v.narrow(1, ks, cols)?;
        let vt = vb.transpose(1, 2)?.contiguous()?;
        let mut dk: Option<Tensor> = None;
        let mut dv: Option<Tensor> = None;
        for (i, &qs) in q_starts.iter().enumerate() {
            let rows = q_block.min(n - qs);
            if causal && ks >= qs + rows {
                continue; // every key of the block is after every query
            }
            let qb = q.narrow(1, qs, rows)?;
            let dob = d_out.narrow(1, qs, rows)?;
            let p = block_scores(&qb, &kb, qs, ks, causal, s)?
                .broadcast_sub(&fwd.lse.narrow(1, qs, rows)?)?
                .exp()?;
            let dv_part = p.transpose(1, 2)?.matmul(&dob)?;
            let dp = dob.matmul(&vt)?;
            let ds = (p * dp.broadcast_sub(&delta.narrow(1, qs, rows)?)?)?;
            let dq_part = (ds.matmul(&kb)? * s)?;
            let dk_part = (ds.transpose(1, 2)?.matmul(&qb)? * s)?;
            dqs[i] = Some(match dqs[i].take() {
                Some(acc) => (acc + dq_part)?,
                None => dq_part,
            });
            dk = Some(match dk {
                Some(acc) => (acc + dk_part)?,
                None => dk_part,
            });
            dv = Some(match dv {
                Some(acc) => (acc + dv_part)?,
                None => dv_part,
            });
        }
        dks.push(match dk {
            Some(t) => t,
            None => kb.zeros_like()?,
        });
        dvs.push(match dv {
            Some(t) => t,
            None => vb.zeros_like()?,
        });
    }
    let dqs = dqs
        .into_iter()
        .zip(&q_starts)
        .map(|(dq, &qs)| match dq {
            Some(t) => Ok(t),
            None => q.narrow(1, qs, q_block.min(n - qs))?.zeros_like(),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((
        Tensor::cat(&dqs, 1)?,
        Tensor::cat(&dks, 1)?,
        Tensor::cat(&dvs, 1)?,
    ))
}

/// Bytes of one `n x n` score matrix per head, for `heads` heads in `dtype`.
///
/// ```
/// use workbook_attention::score_matrix_bytes;
/// use candle_core::DType;
/// // The tutorial's figure: 32 heads at 4096 tokens in f16 is 1.07 GB.
/// assert_eq!(score_matrix_bytes(32, 4096, DType::F16), 1_073_741_824);
/// ```
pub fn score_matrix_bytes(heads: u64, n: u64, dtype: DType) -> u64 {
    heads * n * n * dtype.size_in_bytes() as u64
}

/// Parameters of the attention cell.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Params {
    /// Heads (folded into the batch).
    pub heads: usize,
    /// Dimension per head.
    pub head_dim: usize,
    /// Sequence lengths swept.
    pub lengths: Vec<usize>,
    /// Query rows per chunk (chunked) and per tile (tiled).
    pub q_block: usize,
    /// Key columns per tile (tiled).
    pub k_block: usize,
    /// Sequence length of the equality checks.
    pub check_length: usize,
    /// Timed repetitions per point, methods taking turns (the best is reported).
    pub repeats: usize,
    /// Seed of the data.
    pub seed: u64,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            heads: 8,
            head_dim: 64,
            lengths: vec![256, 512, 1024, 2048, 4096],
            q_block: 256,
            k_block: 256,
            check_length: 256,
            repeats: 3,
            seed: 47,
        }
    }
}

/// The attention plugin.
#[derive(Debug, Default, Clone, Copy)]
pub struct AttentionCell;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Method {
    Naive,
    Chunked,
    Tiled,
}

impl Method {
    fn name(self) -> &'static str {
        match self {
            Method::Naive => "naive",
            Method::Chunked => "chunked",
            Method::Tiled => "tiled",
        }
    }
}

struct Qkv {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    d_out: Tensor,
}

fn qkv(rng: &mut Rng, batch: usize, n: usize, d: usize, device: &Device) -> Result<Qkv> {
    let _inputs = Category::Inputs.enter();
    Ok(Qkv {
        q: rng.randn((batch, n, d), device)?,
        k: rng.randn((batch, n, d), device)?,
        v: rng.randn((batch, n, d), device)?,
        d_out: rng.randn((batch, n, d), device)?,
    })
}

/// Forward and backward of one method: (out, dq, dk, dv). `after_forward`
/// runs between the two (to mark a timeline).
fn forward_backward(
    m: Method,
    x: &Qkv,
    causal: bool,
    p: &Params,
    mut after_forward: impl FnMut(),
) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    match m {
        Method::Naive => {
            let (q, k, v) = (
                Var::from_tensor(&x.q)?,
                Var::from_tensor(&x.k)?,
                Var::from_tensor(&x.v)?,
            );
            let out = Category::Activations.scope(|| naive_attention(&q, &k, &v, causal))?;
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
        Method::Chunked | Method::Tiled => {
            let k_block = if m == Method::Chunked {
                x.k.dim(1)?
            } else {
                p.k_block
            };
            let fwd = Category::Activations.scope(|| match m {
                Method::Chunked => chunked_attention(&x.q, &x.k, &x.v, causal, p.q_block),
                _ => tiled_attention(&x.q, &x.k, &x.v, causal, p.q_block, p.k_block),
            })?;
            after_forward();
            let (dq, dk, dv) = Category::Gradients.scope(|| {
                attention_backward(&x.q, &x.k, &x.v, &fwd, &x.d_out, causal, p.q_block, k_block)
            })?;
            Ok((fwd.out, dq, dk, dv))
        }
    }
}

impl Plugin for AttentionCell {
    type Params = Params;

    fn name(&self) -> &str {
        "attention"
    }

    fn description(&self) -> &str {
        "naive, chunked and tiled attention: equal outputs and gradients, peak and time over N"
    }

    fn validate(&self, p: &Params) -> Vec<Violation> {
        let mut r = Rules::new();
        r.at_least("heads", p.heads, 1)
            .at_least("head_dim", p.head_dim, 1)
            .list("lengths", &p.lengths, 1, 1)
            .at_least("q_block", p.q_block, 1)
            .at_least("k_block", p.k_block, 1)
            .at_least("check_length", p.check_length, 1)
            .at_least("repeats", p.repeats, 1);
        for &n in p.lengths.iter().chain([&p.check_length]) {
            let (h, n, d) = (p.heads as u64, n as u64, p.head_dim as u64);
            // Naive attention holds heads × N × N scores.
            r.elements("lengths", "heads × N × N", &[h, n, n]).elements(
                "lengths",
                "heads × N × head_dim",
                &[h, n, d],
            );
        }
        r.into_violations()
    }

    fn memory_floor(&self, p: &Params) -> Option<(u64, String)> {
        // Naive attention computes the f32 scores of every head at once.
        let n = *p.lengths.iter().chain([&p.check_length]).max()? as u64;
        let bytes = (p.heads as u64)
            .checked_mul(n)?
            .checked_mul(n)?
            .checked_mul(4)?;
        Some((
            bytes,
            format!("the f32 scores of naive attention, {} × {n}²", p.heads),
        ))
    }

    fn run(&self, ctx: &mut Context, p: Params) -> anyhow::Result<()> {
        anyhow::ensure!(
            p.q_block > 0 && p.k_block > 0,
            "q_block and k_block must be at least 1"
        );
        anyhow::ensure!(p.repeats > 0, "repeats must be at least 1");
        let device = ctx.device().clone();
        let mut rng = Rng::seeded(p.seed);

        // Equality with the naive reference, with and without the causal mask.
        let x = qkv(&mut rng, p.heads, p.check_length, p.head_dim, &device)?;
        for causal in [false, true] {
            let (o, dq, dk, dv) = forward_backward(Method::Naive, &x, causal, &p, || {})?;
            for m in [Method::Chunked, Method::Tiled] {
                let (o2, dq2, dk2, dv2) = forward_backward(m, &x, causal, &p, || {})?;
                let tag = format!("{}{}", m.name(), if causal { "_causal" } else { "" });
                ctx.metric(format!("out_diff_{tag}"), max_abs_diff(&o, &o2)?);
                let grad = max_abs_diff(&dq, &dq2)?
                    .max(max_abs_diff(&dk, &dk2)?)
                    .max(max_abs_diff(&dv, &dv2)?);
                ctx.metric(format!("grad_diff_{tag}"), grad);
            }
        }
        drop(x);

        // The sweep over sequence length.
        let methods = [Method::Naive, Method::Chunked, Method::Tiled];
        let mut table = Table::new(
            format!(
                "Forward + backward, {} heads x {} dims, blocks {} x {}",
                p.heads, p.head_dim, p.q_block, p.k_block
            ),
            &[
                ("N", Unit::Count),
                ("naive peak", Unit::Bytes),
                ("chunked peak", Unit::Bytes),
                ("tiled peak", Unit::Bytes),
                ("naive wall", Unit::Seconds),
                ("naive CPU", Unit::Seconds),
                ("chunked wall", Unit::Seconds),
                ("chunked CPU", Unit::Seconds),
                ("tiled wall", Unit::Seconds),
                ("tiled CPU", Unit::Seconds),
            ],
        );
        let mut peaks: Vec<Vec<(f64, f64)>> = vec![Vec::new(); 3];
        let mut times: Vec<Vec<(f64, f64)>> = vec![Vec::new(); 3];
        let mut cpu_times: Vec<Vec<(f64, f64)>> = vec![Vec::new(); 3];
        for &n in &p.lengths {
            let x = qkv(&mut rng, p.heads, n, p.head_dim, &device)?;
            let mut row: Vec<workbook_sdk::serde_json::Value> = vec![n.into()];
            // The methods take turns within each repetition, so that load from
            // elsewhere on the machine falls on all of them alike; the best of
            // the repetitions is reported.
            let mut ts = vec![Vec::new(); methods.len()];
            let mut region_peaks = vec![0u64; methods.len()];
            for rep in 0..p.repeats {
                for (i, &m) in methods.iter().enumerate() {
                    ctx.progress(&format!("{} attention, N = {n}, run {}", m.name(), rep + 1));
                    let mut region = ctx.region(format!("{}, N = {n}", m.name()));
                    let (out, t) = timed(|| {
                        forward_backward(m, &x, false, &p, || region.mark("after forward"))
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
            let mut row_times = Vec::new();
            for i in 0..methods.len() {
                let best = |f: fn(&Timed) -> f64| ts[i].iter().map(f).fold(f64::INFINITY, f64::min);
                let (wall, cpu) = (best(|t| t.wall), best(|t| t.cpu));
                peaks[i].push((n as f64, region_peaks[i] as f64));
                times[i].push((n as f64, wall));
                cpu_times[i].push((n as f64, cpu));
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

        let last = |v: &Vec<(f64, f64)>| v.last().map_or(f64::NAN, |p| p.1);
        let first = |v: &Vec<(f64, f64)>| v.first().map_or(f64::NAN, |p| p.1);
        let (n0, n1) = (
            p.lengths.first().copied().unwrap_or(1) as f64,
            p.lengths.last().copied().unwrap_or(1) as f64,
        );
        // Growth exponent between the shortest and longest N: 2 for N^2, 1 for N.
        let exponent = |v: &Vec<(f64, f64)>| (last(v) / first(v)).ln() / (n1 / n0).ln();
        for (i, m) in methods.iter().enumerate() {
            ctx.metric(format!("peak_{}", m.name()), last(&peaks[i]));
            ctx.metric(format!("time_{}", m.name()), last(&times[i]));
            ctx.metric(format!("growth_{}", m.name()), exponent(&peaks[i]));
        }
        ctx.metric("peak_ratio_naive_tiled", last(&peaks[0]) / last(&peaks[2]));
        // Naive's peak in units of one f32 score matrix for all heads.
        let matrix = (p.heads as f64) * n1 * n1 * 4.0;
        ctx.metric("naive_peak_in_score_matrices", last(&peaks[0]) / matrix);
        ctx.metric("time_ratio_tiled_naive", last(&times[2]) / last(&times[0]));
        ctx.metric(
            "cpu_time_ratio_tiled_naive",
            last(&cpu_times[2]) / last(&cpu_times[0]),
        );
        ctx.metric("largest_n", n1);
        ctx.print(format!(
            "at N = {n1}: naive {:.1} MiB, chunked {:.1} MiB, tiled {:.1} MiB ({:.0}x less than naive); tiled takes {:.2}x naive's wall time, {:.2}x its CPU time",
            last(&peaks[0]) / 1_048_576.0,
            last(&peaks[1]) / 1_048_576.0,
            last(&peaks[2]) / 1_048_576.0,
            last(&peaks[0]) / last(&peaks[2]),
            last(&times[2]) / last(&times[0]),
            last(&cpu_times[2]) / last(&cpu_times[0]),
        ));
        let gb = score_matrix_bytes(32, 4096, DType::F16) as f64 / 1e9;
        ctx.print(format!(
            "one 4096 x 4096 score matrix for 32 heads in f16: {gb:.2} GB"
        ));
        ctx.metric("scores_32h_4096_f16_gb", gb);

        let series = |v: &[Vec<(f64, f64)>]| -> Vec<Series> {
            methods
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
            series: series(&peaks),
            markers: Vec::new(),
            guides: guides(),
        });
        ctx.figure(Figure {
            id: "attention-time".into(),
            title: "Attention time against sequence length".into(),
            x: axis("sequence length N", Unit::Count),
            y: axis("forward + backward wall time, best run", Unit::Seconds),
            series: series(&times),
            markers: Vec::new(),
            guides: guides(),
        });
        Ok(())
    }
}
