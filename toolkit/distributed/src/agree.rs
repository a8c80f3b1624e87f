//! What the ranks check together before they rely on it: that each gave
//! the same variables in the same order, and whole numbers gathered exactly
//! over a library that moves `f32`s.

use std::hash::{DefaultHasher, Hash, Hasher};

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

/// What tells a variable from another without moving it: its dtype, its
/// shape and the bits of its first and last [`SAMPLE`] elements. Equal
/// variables (initialized alike, or broadcast) have equal fingerprints on
/// every rank; two of the same shape initialized at random have different
/// ones.
fn fingerprint(var: &Var) -> Result<u64> {
    let mut h = DefaultHasher::new();
    var.dtype().as_str().hash(&mut h);
    var.dims().hash(&mut h);
    let flat = var.as_tensor().flatten_all()?;
    let n = flat.elem_count();
    let ends = [
        (0, SAMPLE.min(n)),
        (n.saturating_sub(SAMPLE), SAMPLE.min(n)),
    ];
    for (start, len) in ends {
        // An f64 read as f32 is still the same bits on every rank.
        let part = flat.narrow(0, start, len)?.to_dtype(DType::F32)?;
        for x in part.to_vec1::<f32>()? {
            x.to_bits().hash(&mut h);
        }
    }
    Ok(h.finish())
}

/// Checks, on every rank together, that each gave the same variables in the
/// same order (same dtypes, shapes and values, as far as their
/// fingerprints tell): refused alike on every rank otherwise, naming the
/// first variable and rank that differ from rank 0's. `who` names the
/// caller in the message. Nothing moves on one rank.
pub(crate) fn same_vars_on_every_rank(comm: &Comm, vars: &[Var], who: &str) -> Result<()> {
    if comm.size() == 1 {
        return Ok(());
    }
    let advice = "every rank must give the same variables, equal (initialized alike or \
                  broadcast), in the same order (a VarMap's all_vars() is in another order in \
                  each process: sort its variables by name)";
    let counts = gather_u64s(comm, &[vars.len() as u64])?;
    if let Some((r, n)) = counts
        .iter()
        .enumerate()
        .find(|(_, c)| c[0] != counts[0][0])
    {
        bail!(
            "{who}: rank {r} gave {} variables, rank 0 gave {}: {advice}",
            n[0],
            counts[0][0]
        );
    }
    let prints = vars.iter().map(fingerprint).collect::<Result<Vec<_>>>()?;
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

    /// Two thread ranks, the second given other variables three ways:
    /// both ranks refuse, with the first difference named.
    #[test]
    fn ranks_that_gave_other_variables_are_refused_on_every_rank() -> Result<()> {
        let dev = Device::Cpu;
        let w = |seed: f32, shape: (usize, usize)| -> Result<Var> {
            let n = shape.0 * shape.1;
            let t = Tensor::arange(0f32, n as f32, &dev)?.affine(1.0, seed as f64)?;
            Var::from_tensor(&t.reshape(shape)?)
        };
        let same =
            || -> Result<Vec<Var>> { Ok(vec![w(1.0, (3, 4))?, w(2.0, (3, 4))?, w(3.0, (1, 4))?]) };
        let check = |other: &(dyn Fn() -> Result<Vec<Var>> + Sync)| -> Vec<String> {
            std::thread::scope(|s| {
                let handles: Vec<_> = Threads::world(2)
                    .into_iter()
                    .map(|t| {
                        s.spawn(move || {
                            let comm = Comm::new(t);
                            let vars = if comm.rank() == 0 { same() } else { other() }?;
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
        assert_eq!(check(&same), ["ok", "ok"]);
        let advice = "every rank must give the same variables, equal (initialized alike or \
                      broadcast), in the same order (a VarMap's all_vars() is in another order \
                      in each process: sort its variables by name)";
        // The two weights of one shape in the other order.
        let swapped =
            || -> Result<Vec<Var>> { Ok(vec![w(2.0, (3, 4))?, w(1.0, (3, 4))?, w(3.0, (1, 4))?]) };
        assert_eq!(
            check(&swapped),
            [0, 1].map(|r| format!(
                "test: variable 0 differs between rank 0 and rank 1 (in its dtype, shape or \
                 values; on this rank, rank {r}, it is F32 of shape [3, 4]): {advice}"
            ))
        );
        // The last variable initialized otherwise.
        let unequal =
            || -> Result<Vec<Var>> { Ok(vec![w(1.0, (3, 4))?, w(2.0, (3, 4))?, w(4.0, (1, 4))?]) };
        assert_eq!(
            check(&unequal),
            [0, 1].map(|r| format!(
                "test: variable 2 differs between rank 0 and rank 1 (in its dtype, shape or \
                 values; on this rank, rank {r}, it is F32 of shape [1, 4]): {advice}"
            ))
        );
        let fewer = || -> Result<Vec<Var>> { Ok(vec![w(1.0, (3, 4))?, w(2.0, (3, 4))?]) };
        assert_eq!(
            check(&fewer),
            vec![format!("test: rank 1 gave 2 variables, rank 0 gave 3: {advice}"); 2]
        );
        Ok(())
    }

    #[test]
    fn one_rank_or_a_rehearsal_moves_nothing_but_the_check() -> Result<()> {
        let vars = vec![Var::new(&[1f32, 2.0], &Device::Cpu)?];
        let solo = Comm::solo();
        same_vars_on_every_rank(&solo, &vars, "test")?;
        assert_eq!(solo.traffic().total().calls, 0);
        // A rehearsal's stand-ins hold this rank's variables: they agree,
        // after the two all-gathers a real rank sends.
        let four = Comm::new(Rehearsal::new(4)?);
        same_vars_on_every_rank(&four, &vars, "test")?;
        let t = four.traffic();
        assert_eq!(t.all_gather.calls, 2);
        assert_eq!(t.all_gather.sent, 3 * (1 + 1) * 3 * 4);
        Ok(())
    }
}
