//! What the ranks check together before they rely on it: that each gave
//! the same variables in the same order, and whole numbers gathered exactly
//! over a library that moves `f32`s.

use candle_core::{bail, DType, Result, Var};

use crate::Comm;

/// Elements read from each end of a variable for its fingerprint.
const SAMPLE: usize = 8;

/// Bits per piece of a gathered whole number: an `f32` holds every integer
/// up to 2^24 exactly.
const PIECE_BITS: u32 = 24;

/// Pieces of one `u64` (3 × 24 bits ≥ 64).
const PIECES: usize = 3;

/// Every rank's `values`, rank `r`'s at index `r`: one all-gather of three
/// `f32` per value. Every rank must give as many values.
pub(crate) fn gather_u64s(comm: &Comm, values: &[u64]) -> Result<Vec<Vec<u64>>> {
    if values.is_empty() {
        return Ok(vec![Vec::new(); comm.size()]);
    }
    let mask = (1u64 << PIECE_BITS) - 1;
    let send: Vec<f32> = values
        .iter()
        .flat_map(|&v| (0..PIECES).map(move |p| ((v >> (PIECE_BITS * p as u32)) & mask) as f32))
        .collect();
    let mut recv = vec![0f32; send.len() * comm.size()];
    comm.all_gather(&send, &mut recv)?;
    Ok(recv
        .chunks(send.len())
        .map(|rank| {
            rank.chunks(PIECES)
                .map(|pieces| {
                    pieces.iter().enumerate().fold(0u64, |v, (p, &x)| {
                        v | ((x as u64) << (PIECE_BITS * p as u32))
                    })
                })
                .collect()
        })
        .collect())
}

/// FNV-1a over `bytes` from `h`: the same on every rank whatever toolchain
/// built it (std's `DefaultHasher` may change between Rust releases).
fn fnv1a(h: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(h, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// What tells a variable from another without moving it: its dtype, its
/// shape and the bits of its first and last [`SAMPLE`] elements. Equal
/// variables (initialized alike, or broadcast) have equal fingerprints on
/// every rank; two of the same shape initialized at random have different
/// ones.
fn fingerprint(var: &Var) -> Result<u64> {
    let mut h = fnv1a(0xcbf2_9ce4_8422_2325, var.dtype().as_str().as_bytes());
    for &d in var.dims() {
        h = fnv1a(h, &(d as u64).to_le_bytes());
    }
    let flat = var.as_tensor().flatten_all()?;
    let n = flat.elem_count();
    let ends = [
        (0, SAMPLE.min(n)),
        (n.saturating_sub(SAMPLE), SAMPLE.min(n)),
    ];
    for (start, len) in ends {
        let part = flat.narrow(0, start, len)?;
        // An f64 keeps its own bits; every other float is exact in f32.
        if part.dtype() == DType::F64 {
            for x in part.to_vec1::<f64>()? {
                h = fnv1a(h, &x.to_bits().to_le_bytes());
            }
        } else {
            for x in part.to_dtype(DType::F32)?.to_vec1::<f32>()? {
                h = fnv1a(h, &x.to_bits().to_le_bytes());
            }
        }
    }
    Ok(h)
}

/// Checks, on every rank together, that each holds the same variables in
/// the same order (same dtypes, shapes and values, as far as their
/// fingerprints tell): refused alike on every rank otherwise, naming the
/// first variable and rank that differ from rank 0's. `who` names the
/// caller in the message. A rank that cannot take its fingerprints still
/// joins both all-gathers, so that no rank is left waiting.
pub(crate) fn same_vars_on_every_rank(comm: &Comm, vars: &[Var], who: &str) -> Result<()> {
    if comm.size() == 1 {
        return Ok(());
    }
    let advice = "every rank must give the same variables, equal (initialized alike or \
                  broadcast), in the same order (a VarMap's all_vars() is in another order in \
                  each process: sort its variables by name)";
    let prints = vars.iter().map(fingerprint).collect::<Result<Vec<_>>>();
    let heads = gather_u64s(comm, &[vars.len() as u64, u64::from(prints.is_ok())])?;
    let prints = prints?;
    if let Some(r) = heads.iter().position(|h| h[1] == 0) {
        bail!(
            "{who}: rank {r} could not read its variables to compare them (its error is on \
             that rank)"
        );
    }
    if let Some((r, h)) = heads.iter().enumerate().find(|(_, h)| h[0] != heads[0][0]) {
        bail!(
            "{who}: rank {r} gave {} variables, rank 0 gave {}: {advice}",
            h[0],
            heads[0][0]
        );
    }
    let all = gather_u64s(comm, &prints)?;
    for (r, theirs) in all.iter().enumerate().skip(1) {
        if let Some(i) = (0..theirs.len()).find(|&i| theirs[i] != all[0][i]) {
            bail!(
                "{who}: variable {i} differs between rank 0 and rank {r} (in its dtype, shape \
                 or values; on this rank, rank {}, it is {:?} of shape {:?}): {advice}",
                comm.rank(),
                vars[i].dtype(),
                vars[i].dims()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Rehearsal, Threads};
    use candle_core::{Device, Tensor};

    #[test]
    fn whole_numbers_cross_the_f32_collective_exactly() -> Result<()> {
        let values = [
            0,
            1,
            (1 << 24) - 1,
            1 << 24,
            u64::MAX,
            0x0123_4567_89ab_cdef,
        ];
        let got = std::thread::scope(|s| {
            let handles: Vec<_> = Threads::world(2)
                .into_iter()
                .map(|t| {
                    s.spawn(move || {
                        let comm = Comm::new(t);
                        let mine: Vec<u64> =
                            values.iter().map(|v| v ^ comm.rank() as u64).collect();
                        gather_u64s(&comm, &mine)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        for ranks in got {
            let ranks = ranks?;
            assert_eq!(ranks[0], values);
            assert_eq!(ranks[1], values.map(|v| v ^ 1));
        }
        Ok(())
    }

    #[test]
    fn fingerprints_tell_dtype_shape_and_values_apart() -> Result<()> {
        let dev = Device::Cpu;
        let a = Tensor::arange(0f32, 20.0, &dev)?;
        let print = |t: &Tensor| fingerprint(&Var::from_tensor(t)?);
        assert_eq!(print(&a)?, print(&a.copy()?)?);
        assert_ne!(print(&a)?, print(&a.reshape((4, 5))?)?);
        assert_ne!(print(&a)?, print(&a.to_dtype(DType::BF16)?)?);
        // The last element alone differs.
        let b = Tensor::cat(&[a.narrow(0, 0, 19)?, Tensor::new(&[0f32], &dev)?], 0)?;
        assert_ne!(print(&a)?, print(&b)?);
        // Fewer elements than both ends' samples.
        assert_ne!(print(&a.narrow(0, 0, 3)?)?, print(&a.narrow(0, 1, 3)?)?);
        Ok(())
    }

    /// Two thread ranks, the second given other variables five ways: both
    /// ranks refuse, with the first difference named. The variables are of
    /// f32, bf16 and f64, one of no elements and a scalar.
    #[test]
    fn ranks_that_gave_other_variables_are_refused_on_every_rank() -> Result<()> {
        let dev = Device::Cpu;
        let w = |seed: f32, shape: (usize, usize)| -> Result<Tensor> {
            let n = shape.0 * shape.1;
            Tensor::arange(0f32, n as f32, &dev)?
                .affine(1.0, seed as f64)?
                .reshape(shape)
        };
        // Rank 0's variables, the i-th replaced by `swap`'s where given.
        let with = |swap: &[(usize, Tensor)]| -> Result<Vec<Var>> {
            let mut ts = [
                w(1.0, (3, 4))?,
                w(2.0, (3, 4))?,
                w(3.0, (1, 4))?,
                w(5.0, (2, 2))?.to_dtype(DType::BF16)?,
                Tensor::new(&[0.1f64, 0.2], &dev)?,
                Tensor::zeros((0, 3), DType::F32, &dev)?,
                Tensor::new(7f32, &dev)?,
            ];
            for (i, t) in swap {
                ts[*i] = t.clone();
            }
            ts.iter().map(Var::from_tensor).collect()
        };
        let check = |other: Vec<(usize, Tensor)>, len: usize| -> Vec<String> {
            std::thread::scope(|s| {
                let handles: Vec<_> = Threads::world(2)
                    .into_iter()
                    .map(|t| {
                        let other = &other;
                        s.spawn(move || {
                            let comm = Comm::new(t);
                            let mut vars = with(if comm.rank() == 0 { &[] } else { other })?;
                            if comm.rank() == 1 {
                                vars.truncate(len);
                            }
                            same_vars_on_every_rank(&comm, &vars, "test")
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| match h.join().unwrap() {
                        Ok(()) => "ok".to_string(),
                        Err(e) => e.to_string().lines().next().unwrap_or("").to_string(),
                    })
                    .collect()
            })
        };
        assert_eq!(check(vec![], 7), ["ok", "ok"]);
        let advice = "every rank must give the same variables, equal (initialized alike or \
                      broadcast), in the same order (a VarMap's all_vars() is in another order \
                      in each process: sort its variables by name)";
        let differs = |i: usize, what: &str| {
            [0, 1].map(|r| {
                format!(
                    "test: variable {i} differs between rank 0 and rank 1 (in its dtype, shape \
                     or values; on this rank, rank {r}, it is {what}): {advice}"
                )
            })
        };
        // The two weights of one shape in the other order.
        let swapped = vec![(0, w(2.0, (3, 4))?), (1, w(1.0, (3, 4))?)];
        assert_eq!(check(swapped, 7), differs(0, "F32 of shape [3, 4]"));
        // A variable initialized otherwise.
        assert_eq!(
            check(vec![(2, w(4.0, (1, 4))?)], 7),
            differs(2, "F32 of shape [1, 4]")
        );
        // An f64 that differs below f32's precision.
        let close = Tensor::new(&[0.1f64 + 1e-12, 0.2], &dev)?;
        assert_eq!(check(vec![(4, close)], 7), differs(4, "F64 of shape [2]"));
        // The same values in another float type: this rank's dtype named.
        let f16 = w(5.0, (2, 2))?.to_dtype(DType::F16)?;
        let got = check(vec![(3, f16)], 7);
        assert_eq!(got[0], differs(3, "BF16 of shape [2, 2]")[0]);
        assert_eq!(got[1], differs(3, "F16 of shape [2, 2]")[1]);
        assert_eq!(
            check(vec![], 6),
            vec![format!("test: rank 1 gave 6 variables, rank 0 gave 7: {advice}"); 2]
        );
        Ok(())
    }

    #[test]
    fn one_rank_moves_nothing_and_a_rehearsal_what_a_real_rank_sends() -> Result<()> {
        let vars = vec![Var::new(&[1f32, 2.0], &Device::Cpu)?];
        let solo = Comm::solo();
        same_vars_on_every_rank(&solo, &vars, "test")?;
        assert_eq!(solo.traffic().total().calls, 0);
        // Two all-gathers: two whole numbers (the count and whether the
        // fingerprints could be taken), then one per variable, three f32
        // each, to the three other ranks.
        let four = Comm::new(Rehearsal::new(4)?);
        same_vars_on_every_rank(&four, &vars, "test")?;
        let t = four.traffic();
        assert_eq!(t.all_gather.calls, 2);
        assert_eq!(t.all_gather.sent, 3 * (2 + 1) * 3 * 4);
        Ok(())
    }
}
