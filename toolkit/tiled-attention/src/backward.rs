//! The recomputing backward.

use candle_core::{Result, Tensor, D};

use crate::forward::{block_scores, scale_of, visible_keys, Forward};
use crate::shapes::{accumulation, fold, unfold_kv, Dims};

fn add(acc: Option<Tensor>, part: Tensor) -> Result<Tensor> {
    match acc {
        Some(a) => a + part,
        None => Ok(part),
    }
}

/// [`Forward::backward`].
pub(crate) fn backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    fwd: &Forward,
    d_out: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    // Validated by the forward that made `fwd`.
    let cfg = &fwd.cfg;
    crate::forward::same_inputs(&fwd.inputs, q, k, v)?;
    let dims = Dims::of(q, k, v)?;
    if d_out.dims() != fwd.out.dims() {
        candle_core::bail!(
            "d_out has shape {:?}, the forward's output {:?}",
            d_out.dims(),
            fwd.out.dims()
        );
    }
    // The output and log-sum-exp are public fields: one replaced by another
    // of other rows would read past the saved ones.
    let made = [dims.batch, dims.q_heads, dims.nq, dims.dv];
    if fwd.out.dims() != made || fwd.lse.dims() != &made[..3] {
        candle_core::bail!(
            "the forward's output has shape {:?} and its log-sum-exp {:?}: not those of its \
             inputs, {made:?} and {:?}",
            fwd.out.dims(),
            fwd.lse.dims(),
            &made[..3]
        );
    }
    if dims.nq == 0 || dims.nk == 0 || dims.rows() == 0 {
        return Ok((q.zeros_like()?, k.zeros_like()?, v.zeros_like()?));
    }
    let s = scale_of(cfg, dims.d);
    if crate::cpu::applies(q, &dims) {
        return crate::cpu::backward(q, k, v, fwd, d_out, &dims, cfg, s);
    }
    #[cfg(feature = "cuda")]
    if let Some(plan) = crate::flash_cuda::applies(q, &dims) {
        return crate::flash_cuda::backward([q, k, v], fwd, d_out, &dims, &plan, s);
    }
    let acc = accumulation(q.dtype());
    let fold_q = |t: &Tensor| -> Result<Tensor> {
        t.detach()
            .to_dtype(acc)?
            .contiguous()?
            .reshape((dims.rows(), dims.nq, ()))
    };
    let (q3, k3, v3) = (
        fold_q(q)?,
        fold(&k.detach(), &dims, acc)?,
        fold(&v.detach(), &dims, acc)?,
    );
    let (do3, o3) = (fold_q(d_out)?, fold_q(&fwd.out)?);
    let lse = fwd
        .lse
        .detach()
        .to_dtype(acc)?
        .reshape((dims.rows(), dims.nq, 1))?;
    // rowsum(dO * O): the softmax backward's correction term.
    let delta = (&do3 * &o3)?.sum_keepdim(D::Minus1)?;
    drop(o3);
    let q_starts: Vec<usize> = (0..dims.nq).step_by(cfg.q_block).collect();
    let mut dqs: Vec<Option<Tensor>> = vec![None; q_starts.len()];
    let mut dks = Vec::new();
    let mut dvs = Vec::new();
    // Key blocks outside, as FlashAttention-2: a key block's dK and dV are
    // finished before the next; dQ is summed block by block.
    for ks in (0..dims.nk).step_by(cfg.k_block) {
        let cols = cfg.k_block.min(dims.nk - ks);
        let kb = k3.narrow(1, ks, cols)?;
        let vb = v3.narrow(1, ks, cols)?;
        let vt = vb.transpose(1, 2)?;
        let mut dk: Option<Tensor> = None;
        let mut dv: Option<Tensor> = None;
        for (i, &qs) in q_starts.iter().enumerate() {
            let rows = cfg.q_block.min(dims.nq - qs);
            if ks >= visible_keys(cfg, qs, rows, dims.nk) {
                continue; // every key of the block is after every query
            }
            let qb = q3.narrow(1, qs, rows)?;
            let dob = do3.narrow(1, qs, rows)?;
            let p = block_scores(&qb, &kb, qs, ks, cfg.causal, s)?
                .broadcast_sub(&lse.narrow(1, qs, rows)?)?
                .exp()?;
            let dv_part = p.transpose(1, 2)?.matmul(&dob)?;
            let dp = dob.matmul(&vt)?;
            let ds = (p * dp.broadcast_sub(&delta.narrow(1, qs, rows)?)?)?;
            let dq_part = (ds.matmul(&kb)? * s)?;
            let dk_part = (ds.transpose(1, 2)?.matmul(&qb)? * s)?;
            dqs[i] = Some(add(dqs[i].take(), dq_part)?);
            dk = Some(add(dk, dk_part)?);
            dv = Some(add(dv, dv_part)?);
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
            None => q3
                .narrow(1, qs, cfg.q_block.min(dims.nq - qs))?
                .zeros_like(),
        })
        .collect::<Result<Vec<_>>>()?;
    let dq = Tensor::cat(&dqs, 1)?
        .reshape(q.dims())?
        .to_dtype(q.dtype())?;
    let dk = unfold_kv(&Tensor::cat(&dks, 1)?, &dims, k.dtype())?;
    let dv = unfold_kv(&Tensor::cat(&dvs, 1)?, &dims, v.dtype())?;
    Ok((dq, dk, dv))
}
