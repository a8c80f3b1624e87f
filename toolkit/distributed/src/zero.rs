//! ZeRO stages 1 and 2: the optimizer state (and the gradients) partitioned
//! over the ranks, the parameters whole on every rank.

use std::path::Path;
use std::sync::Arc;

use candle_amp::InfCheck;
use candle_core::backprop::GradStore;
use candle_core::{bail, DType, Device, Result, Tensor, Var};
use candle_lean_optim::{adamw_update, save_state, AdamWStep, StateFile};
use candle_nn::{Optimizer, ParamsAdamW};
use candle_observe::{scope, Kind, Place};

use crate::agree::{gather_u64s, same_vars_on_every_rank};
use crate::split::{all_gather_whole, own_block, reduce_scatter_mean, Split};
use crate::Comm;

/// One parameter: whole on every rank; its block of the state on this one.
#[derive(Debug)]
struct Slot {
    var: Var,
    split: Split,
    /// The f32 master copy of this rank's block, for a parameter that is not
    /// f32 itself (mixed precision). An f32 parameter is its own master.
    master: Option<Var>,
    m: Var,
    v: Var,
    /// This rank's block of the gradient averaged over the ranks, in f32,
    /// summed over the backward passes since the last step.
    grad: Option<Tensor>,
}

/// AdamW with ZeRO's partitioned state (Rajbhandari et al. 2020): each of
/// `N` ranks keeps the moments (and, for parameters not in f32, the f32
/// master weights) of one `1/N` block of every parameter, updates that
/// block, and all-gathers the updated blocks into the whole parameters.
///
/// * **Stage 1**: after the backward, [`step`](Self::step) reduce-scatters
///   each gradient (every rank held all of them through the backward) and
///   updates.
/// * **Stage 2**: during the backward, [`reduce_gradient`](Self::reduce_gradient)
///   reduce-scatters each gradient as soon as it exists and keeps only this
///   rank's block (with a backward that hands gradients over one layer at a
///   time, such as `candle_checkpoint::Sequential::each_layer`); then
///   [`step_reduced`](Self::step_reduced).
///
/// A reduce-scatter and an all-gather per step move what DDP's all-reduce
/// moves. Its arithmetic is `candle_lean_optim`'s, so in f32 the parameters
/// equal those of `candle_nn::AdamW` on the averaged gradients (up to the
/// order of the sums over ranks).
#[derive(Debug)]
pub struct ZeroAdamW {
    comm: Arc<Comm>,
    slots: Vec<Slot>,
    params: ParamsAdamW,
    step_t: usize,
}

impl ZeroAdamW {
    /// Partitions the state of `vars` over `comm`'s ranks. The parameters
    /// must be equal on every rank (initialized alike, or broadcast) and
    /// given in the same order on every rank and every run: the i-th
    /// variable's blocks are reduced, gathered and saved as the i-th. A
    /// `VarMap`'s `all_vars()` is a hash map's order, another in each
    /// process: sort its variables by name first. The ranks check this
    /// together (`new` is collective): each variable's dtype, shape and the
    /// bits of its first and last elements are compared with rank 0's, and
    /// a difference is refused on every rank. Variables that are not floats
    /// are left out, as `candle_nn::AdamW` leaves them.
    pub fn new(comm: Arc<Comm>, vars: Vec<Var>, params: ParamsAdamW) -> Result<Self> {
        let ranks = comm.size();
        // An integer variable (a step counter, a mask) has no gradient to
        // step: skipped, as candle's AdamW skips it.
        let vars: Vec<Var> = vars.into_iter().filter(|v| v.dtype().is_float()).collect();
        same_vars_on_every_rank(&comm, &vars, "ZeroAdamW::new")?;
        let mut slots = Vec::with_capacity(vars.len());
        for var in vars {
            let split = Split::new(var.elem_count(), ranks);
            let _state = scope(comm.observer(), Kind::OptimizerState, Place::Device);
            let zeros = || Var::zeros(split.block(), DType::F32, var.device());
            let master = if var.dtype() == DType::F32 {
                None
            } else {
                let block = own_block(&comm, var.as_tensor(), split)?;
                Some(Var::from_slice(&block, split.block(), var.device())?)
            };
            slots.push(Slot {
                split,
                master,
                m: zeros()?,
                v: zeros()?,
                grad: None,
                var,
            });
        }
        Ok(Self {
            comm,
            slots,
            params,
            step_t: 0,
        })
    }

    /// The hyper-parameters.
    pub fn params(&self) -> &ParamsAdamW {
        &self.params
    }

    /// Sets the hyper-parameters (a schedule, say). Every rank must set
    /// the same, or their blocks step differently.
    pub fn set_params(&mut self, params: ParamsAdamW) {
        self.params = params;
    }

    /// Steps taken.
    pub fn step_count(&self) -> usize {
        self.step_t
    }

    /// Writes this rank's share of the state to `path` (safetensors): the
    /// step count, the hyper-parameters, its blocks of the moments and of
    /// the f32 masters, and which rank of how many it is. Each rank writes
    /// its own file, as DeepSpeed's checkpoints do.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let tensors = self.slots.iter().enumerate().flat_map(|(i, s)| {
            let master = s
                .master
                .as_ref()
                .map(|w| (format!("master.{i}"), w.as_tensor().clone()));
            [
                (format!("m.{i}"), s.m.as_tensor().clone()),
                (format!("v.{i}"), s.v.as_tensor().clone()),
            ]
            .into_iter()
            .chain(master)
        });
        // Each variable's whole shape: the blocks alone would not tell a
        // (3, 4) from a (4, 3).
        let shapes = self.slots.iter().enumerate().map(|(i, s)| {
            let shape = shape_record(s.var.dims());
            Ok((format!("shape.{i}"), Tensor::new(shape, &Device::Cpu)?))
        });
        let shapes = shapes.collect::<Result<Vec<_>>>()?;
        let rank = [self.comm.rank() as f64, self.comm.size() as f64];
        let rank = ("zero.rank".to_string(), Tensor::new(&rank, &Device::Cpu)?);
        save_state(
            path.as_ref(),
            self.step_t,
            &self.params,
            tensors.chain(shapes).chain([rank]),
        )
    }

    /// Restores what [`save`](Self::save) wrote on this rank, for the same
    /// variables in the same order over as many ranks. Every rank calls it
    /// (it is collective): each reads and checks its own file, then the
    /// ranks tell each other whether they could and at which step, and
    /// restore only if every rank could, at the same step. A file of
    /// another rank, of other variables or of another step than the other
    /// ranks' is refused on every rank before anything is restored. The
    /// parameters are not in the file: restore them from the model's
    /// checkpoint of the same step, alike on every rank, before the next
    /// step (an f32 parameter is its own master; one that is not f32 is
    /// overwritten by the next step from its restored f32 master block).
    /// [`new`](Self::new) already asks for parameters equal on every rank:
    /// restore them before it, or initialize them alike.
    /// Gradient blocks reduced before the load are dropped.
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let local = self.read_state(path);
        let steps = self.gather_steps(local.as_ref().ok().map(StateFile::step))?;
        let mut loaded = local?;
        let step = loaded.step();
        for (r, other) in steps.iter().enumerate() {
            match other {
                None => bail!(
                    "{}: not loaded: rank {r} of {} could not load its state (its error is \
                     on that rank), and the ranks restore together or not at all",
                    path.display(),
                    steps.len()
                ),
                Some(s) if *s != step => bail!(
                    "{}: not loaded: the state of step {step}, but rank {r}'s is of step {s}: \
                     every rank loads the state saved at the same step",
                    path.display()
                ),
                Some(_) => {}
            }
        }
        for (i, s) in self.slots.iter_mut().enumerate() {
            loaded.restore(&format!("m.{i}"), &s.m)?;
            loaded.restore(&format!("v.{i}"), &s.v)?;
            if let Some(master) = &s.master {
                loaded.restore(&format!("master.{i}"), master)?;
            }
            // Gradients of before the save are not this state's.
            s.grad = None;
        }
        self.step_t = step;
        self.params = loaded.params().clone();
        loaded.finish()
    }

    /// Reads `path` and checks it against this rank and these variables,
    /// restoring nothing.
    fn read_state(&self, path: &Path) -> Result<StateFile> {
        let mut loaded = StateFile::read(path)?;
        let (rank, ranks) = (self.comm.rank(), self.comm.size());
        let saved = match loaded.take("zero.rank") {
            Some(t) => t.to_dtype(DType::F64)?.to_vec1::<f64>()?,
            None => bail!(
                "{}: holds no ZeroAdamW state (no zero.rank)",
                path.display()
            ),
        };
        let [saved_rank, saved_ranks] = saved[..] else {
            bail!("{}: malformed ZeroAdamW state (zero.rank)", path.display());
        };
        if (saved_rank, saved_ranks) != (rank as f64, ranks as f64) {
            bail!(
                "{}: the state of rank {saved_rank} of {saved_ranks}; this is rank {rank} of \
                 {ranks}: each rank loads the file it saved, over as many ranks",
                path.display(),
            );
        }
        for (i, s) in self.slots.iter().enumerate() {
            let saved = match loaded.take(&format!("shape.{i}")) {
                Some(t) => t.to_dtype(DType::F64)?.to_vec1::<f64>()?,
                None => bail!(
                    "{} has no shape.{i}: was it saved for as many variables?",
                    path.display()
                ),
            };
            if saved != shape_record(s.var.dims()) {
                let shape: Vec<u64> = saved.iter().skip(1).map(|&d| d as u64).collect();
                bail!(
                    "{}: variable {i} was saved of shape {shape:?}, this optimizer's is {:?}: \
                     give the same variables in the same order as when it was saved",
                    path.display(),
                    s.var.dims()
                );
            }
        }
        loaded.check(self.slots.iter().enumerate().flat_map(|(i, s)| {
            let master = s.master.as_ref().map(|w| (format!("master.{i}"), w));
            [(format!("m.{i}"), &s.m), (format!("v.{i}"), &s.v)]
                .into_iter()
                .chain(master)
        }))?;
        Ok(loaded)
    }

    /// Every rank's step as it read it (`None`: it could not read its
    /// state), rank `r` at index `r`: one all-gather of two whole numbers
    /// per rank.
    fn gather_steps(&self, step: Option<usize>) -> Result<Vec<Option<usize>>> {
        let send = [u64::from(step.is_some()), step.unwrap_or(0) as u64];
        Ok(gather_u64s(&self.comm, &send)?
            .into_iter()
            .map(|r| (r[0] == 1).then_some(r[1] as usize))
            .collect())
    }

    /// The bytes of optimizer state this rank holds: moments and master
    /// blocks.
    pub fn state_bytes(&self) -> u64 {
        let per_slot = |s: &Slot| {
            let blocks = 2 + usize::from(s.master.is_some());
            (blocks * s.split.block() * 4) as u64
        };
        self.slots.iter().map(per_slot).sum()
    }

    /// The bytes of gradient blocks held for the next step.
    pub fn gradient_bytes(&self) -> u64 {
        self.slots
            .iter()
            .filter_map(|s| s.grad.as_ref())
            .map(|g| (g.elem_count() * 4) as u64)
            .sum()
    }

    /// This rank's block of `var`'s gradient, averaged over the ranks and
    /// summed over the backward passes since the last step (stage 2's
    /// [`reduce_gradient`](Self::reduce_gradient)): `split.block()` f32
    /// elements, the part past the tensor's end zero. `None` for a variable
    /// this optimizer does not update, or that has had no gradient since
    /// the last step. What a gradient norm for clipping, or a check, reads.
    pub fn gradient_block(&self, var: &Var) -> Option<&Tensor> {
        self.slots
            .iter()
            .find(|s| s.var.id() == var.id())
            .and_then(|s| s.grad.as_ref())
    }

    /// Stage 2: reduce-scatters `grad`, the gradient of `var` on this rank,
    /// and keeps this rank's block of its mean over the ranks. Every rank
    /// must hand over the same variables in the same order.
    pub fn reduce_gradient(&mut self, var: &Var, grad: &Tensor) -> Result<()> {
        let Some(i) = self.slots.iter().position(|s| s.var.id() == var.id()) else {
            bail!("ZeroAdamW: a gradient for a variable it does not update");
        };
        self.reduce(i, grad)
    }

    fn reduce(&mut self, i: usize, grad: &Tensor) -> Result<()> {
        let comm = &self.comm;
        let slot = &mut self.slots[i];
        if grad.elem_count() != slot.split.len() {
            bail!(
                "ZeroAdamW: a gradient of {} elements for a parameter of {}",
                grad.elem_count(),
                slot.split.len()
            );
        }
        let mean = reduce_scatter_mean(comm, grad, slot.split, slot.var.device())?;
        let _grads = scope(comm.observer(), Kind::Gradients, Place::Device);
        slot.grad = Some(match slot.grad.take() {
            Some(sum) => (sum + mean)?,
            None => mean,
        });
        Ok(())
    }

    /// Multiplies this rank's gradient blocks by `factor` (a loss scaler's
    /// `1 / scale`) and says whether any rank's blocks hold an inf or NaN.
    /// Every rank gets the same answer (one number all-reduced), so the
    /// ranks skip or step together where each checking its own block alone
    /// could leave one stepping while another skips. Hand it to
    /// `candle_amp::GradScaler::record_inf_check`, then
    /// [`step_reduced`](Self::step_reduced), or
    /// [`discard_gradients`](Self::discard_gradients) when it is true. An
    /// error with no gradient block to check, on every rank alike (they
    /// hold the same variables' gradients).
    pub fn unscale_gradients(&mut self, factor: f64) -> Result<bool> {
        let mut check = InfCheck::default();
        for slot in &mut self.slots {
            let Some(g) = slot.grad.take() else { continue };
            let g = g.affine(factor, 0.0)?;
            check.add(&g)?;
            slot.grad = Some(g);
        }
        let Some(local) = check.found()? else {
            bail!(
                "ZeroAdamW: no gradient block to unscale: reduce the gradients first \
                 (reduce_gradient)"
            );
        };
        let mut found = [f32::from(local)];
        self.comm.all_reduce_sum(&mut found)?;
        Ok(found[0] != 0.0)
    }

    /// Drops this rank's gradient blocks: a step skipped for an inf or NaN,
    /// or a backward that failed half way, so that they do not join the
    /// next step's.
    pub fn discard_gradients(&mut self) {
        for slot in &mut self.slots {
            slot.grad = None;
        }
    }

    /// Stage 1: reduce-scatters every gradient in `grads`, then updates as
    /// [`step_reduced`](Self::step_reduced).
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        for i in 0..self.slots.len() {
            if let Some(g) = grads.get(self.slots[i].var.as_tensor()) {
                let g = g.clone();
                self.reduce(i, &g)?;
            }
        }
        self.step_reduced()
    }

    /// Updates this rank's block of every parameter that has a gradient
    /// block, then all-gathers the blocks into the whole parameters.
    pub fn step_reduced(&mut self) -> Result<()> {
        self.step_t += 1;
        let k = AdamWStep::new(&self.params, self.step_t)?;
        let comm = &self.comm;
        for slot in &mut self.slots {
            // Every rank has the same variables' gradients (the same model
            // and backward), so every rank skips the same ones.
            let Some(g) = slot.grad.take() else { continue };
            let split = slot.split;
            let block = match &slot.master {
                Some(master) => master.clone(),
                None => {
                    // An f32 parameter's own block, taken out to update.
                    let block = own_block(comm, slot.var.as_tensor(), split)?;
                    Var::from_vec(block, split.block(), slot.var.device())?
                }
            };
            {
                let _state = scope(comm.observer(), Kind::OptimizerState, Place::Device);
                adamw_update(&block, (&slot.m, &slot.v), &g, &k)?;
            }
            drop(g);
            let whole = all_gather_whole(
                comm,
                &block,
                split,
                slot.var.shape(),
                slot.var.dtype(),
                slot.var.device(),
                Kind::Communication,
            )?;
            slot.var.set(&whole)?;
        }
        Ok(())
    }
}

/// A variable's shape as [`ZeroAdamW::save`] writes it, `[ndims, dims...]`:
/// never empty, a scalar's included.
fn shape_record(dims: &[usize]) -> Vec<f64> {
    std::iter::once(dims.len() as f64)
        .chain(dims.iter().map(|&d| d as f64))
        .collect()
}

/// What [`ZeroAdamW`] is made from through candle's [`Optimizer`] trait:
/// the ranks that share its state, and AdamW's hyper-parameters.
#[derive(Debug, Clone)]
pub struct ZeroConfig {
    /// The ranks the state is partitioned over.
    pub comm: Arc<Comm>,
    /// AdamW's hyper-parameters.
    pub params: ParamsAdamW,
}

/// ZeRO stage 1 as a candle optimizer: [`Optimizer::step`] is
/// [`ZeroAdamW::step`], so a training loop (or a schedule) written for any
/// candle optimizer takes it.
impl Optimizer for ZeroAdamW {
    type Config = ZeroConfig;

    fn new(vars: Vec<Var>, config: ZeroConfig) -> Result<Self> {
        ZeroAdamW::new(config.comm, vars, config.params)
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        ZeroAdamW::step(self, grads)
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_lean_optim::LeanAdamW;
    use candle_nn::Optimizer;

    use crate::Threads;

    /// A bf16 parameter keeps an f32 master block: one rank's ZeroAdamW
    /// equals LeanAdamW on an f32 copy, cast back to bf16 after each step.
    #[test]
    fn a_half_precision_parameter_steps_from_its_f32_master() -> Result<()> {
        let dev = candle_core::Device::Cpu;
        let init: Vec<f32> = (0..10).map(|i| (i as f32 - 4.5) * 0.37).collect();
        let half = Var::from_tensor(&Tensor::new(init.as_slice(), &dev)?.to_dtype(DType::BF16)?)?;
        let master = Var::from_tensor(&half.as_tensor().to_dtype(DType::F32)?)?;
        let p = ParamsAdamW {
            lr: 0.05,
            ..Default::default()
        };
        let mut zero = ZeroAdamW::new(Arc::new(Comm::solo()), vec![half.clone()], p.clone())?;
        assert_eq!(zero.state_bytes(), 3 * 10 * 4);
        let mut reference = LeanAdamW::new(vec![master.clone()], p)?;
        for step in 0..3 {
            let g: Vec<f32> = (0..10)
                .map(|i| ((i * 7 + step) % 5) as f32 * 0.1 - 0.2)
                .collect();
            let g = Tensor::new(g.as_slice(), &dev)?;
            let mut grads = GradStore::default();
            grads.insert(half.as_tensor(), g.to_dtype(DType::BF16)?);
            zero.step(&grads)?;
            let mut grads = GradStore::default();
            grads.insert(
                master.as_tensor(),
                g.to_dtype(DType::BF16)?.to_dtype(DType::F32)?,
            );
            reference.step(&grads)?;
            let want = master
                .as_tensor()
                .to_dtype(DType::BF16)?
                .to_dtype(DType::F32)?;
            let got = half.as_tensor().to_dtype(DType::F32)?;
            assert_eq!(got.to_vec1::<f32>()?, want.to_vec1::<f32>()?, "step {step}");
        }
        Ok(())
    }

    /// A loss whose gradient differs each step.
    fn loss(vars: &[Var], step: usize) -> Result<Tensor> {
        let mut total = Tensor::new(0f32, &candle_core::Device::Cpu)?;
        for (i, v) in vars.iter().enumerate() {
            let t = (v.as_tensor().to_dtype(DType::F32)? - ((step + i) as f64 * 0.1))?;
            total = (total + t.sqr()?.sum_all()?)?;
        }
        Ok(total)
    }

    fn vars(dtype: DType) -> Result<Vec<Var>> {
        let dev = candle_core::Device::Cpu;
        [(3usize, 4usize), (5, 1)]
            .iter()
            .map(|&(a, b)| {
                let data: Vec<f32> = (0..a * b).map(|j| (j % 7) as f32 * 0.3 - 0.9).collect();
                Var::from_tensor(&Tensor::from_vec(data, (a, b), &dev)?.to_dtype(dtype)?)
            })
            .collect()
    }

    fn values(vars: &[Var]) -> Result<Vec<Vec<f32>>> {
        vars.iter()
            .map(|v| v.as_tensor().to_dtype(DType::F32)?.flatten_all()?.to_vec1())
            .collect()
    }

    /// Any candle optimizer, its learning rate halved each step.
    fn scheduled<O: Optimizer>(opt: &mut O, vars: &[Var], steps: usize) -> Result<()> {
        for step in 0..steps {
            opt.set_learning_rate(opt.learning_rate() * 0.5);
            opt.backward_step(&loss(vars, step)?)?;
        }
        Ok(())
    }

    #[test]
    fn through_candles_optimizer_trait_a_schedule_steps_as_lean_adamw() -> Result<()> {
        let (a, b) = (vars(DType::F32)?, vars(DType::F32)?);
        let p = ParamsAdamW {
            lr: 0.2,
            ..Default::default()
        };
        let config = ZeroConfig {
            comm: Arc::new(Comm::solo()),
            params: p.clone(),
        };
        let mut zero = <ZeroAdamW as Optimizer>::new(a.clone(), config)?;
        scheduled(&mut zero, &a, 4)?;
        scheduled(&mut LeanAdamW::new(b.clone(), p)?, &b, 4)?;
        assert_eq!(zero.learning_rate(), 0.2 / 16.0);
        assert_eq!(zero.step_count(), 4);
        assert_eq!(values(&a)?, values(&b)?);
        Ok(())
    }

    #[test]
    fn a_saved_state_resumes_exactly_and_another_ranks_is_refused() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("zero-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("rank0.safetensors");
        let p = ParamsAdamW {
            lr: 0.05,
            weight_decay: 0.1,
            ..Default::default()
        };
        let solo = || Arc::new(Comm::solo());
        let run = |opt: &mut ZeroAdamW, vars: &[Var], mut steps: std::ops::Range<usize>| {
            steps.try_for_each(|s| opt.step(&loss(vars, s)?.backward()?))
        };
        // f32, and bf16 parameters stepped from their f32 masters.
        for dtype in [DType::F32, DType::BF16] {
            let (a, b) = (vars(dtype)?, vars(dtype)?);
            run(&mut ZeroAdamW::new(solo(), a.clone(), p.clone())?, &a, 0..6)?;
            let mut first = ZeroAdamW::new(solo(), b.clone(), p.clone())?;
            run(&mut first, &b, 0..3)?;
            first.save(&file)?;
            drop(first);
            let mut second = ZeroAdamW::new(solo(), b.clone(), ParamsAdamW::default())?;
            second.load(&file)?;
            assert_eq!(second.step_count(), 3);
            assert_eq!(second.params().weight_decay, 0.1);
            run(&mut second, &b, 3..6)?;
            assert_eq!(values(&a)?, values(&b)?, "{dtype:?}");
        }

        // Rank 0 of 1's state is not rank 0 of 4's share.
        let four = Arc::new(Comm::new(crate::Rehearsal::new(4)?));
        let e = ZeroAdamW::new(four, vars(DType::BF16)?, p.clone())?
            .load(&file)
            .unwrap_err();
        assert_eq!(
            e.to_string().lines().next(),
            Some(
                format!(
                    "{}: the state of rank 0 of 1; this is rank 0 of 4: each rank loads the \
                     file it saved, over as many ranks",
                    file.display()
                )
                .as_str()
            )
        );
        // Other variables, whose blocks are of the same sizes: refused, and
        // nothing restored; the refused optimizer steps on as its twin.
        let swapped = || -> Result<Vec<Var>> {
            let mut v = vars(DType::BF16)?;
            v[1] = Var::from_tensor(&v[1].as_tensor().reshape((1, 5))?)?;
            Ok(v)
        };
        let (a, b) = (swapped()?, swapped()?);
        let mut tried = ZeroAdamW::new(solo(), a.clone(), p.clone())?;
        let mut twin = ZeroAdamW::new(solo(), b.clone(), p.clone())?;
        run(&mut tried, &a, 0..2)?;
        run(&mut twin, &b, 0..2)?;
        let e = tried.load(&file).unwrap_err();
        assert_eq!(
            e.to_string().lines().next(),
            Some(
                format!(
                    "{}: variable 1 was saved of shape [5, 1], this optimizer's is [1, 5]: give \
                     the same variables in the same order as when it was saved",
                    file.display()
                )
                .as_str()
            )
        );
        assert_eq!(tried.step_count(), 2);
        run(&mut tried, &a, 2..4)?;
        run(&mut twin, &b, 2..4)?;
        assert_eq!(values(&a)?, values(&b)?);
        // The bf16 state in an f32 optimizer: masters it keeps none of.
        let e = ZeroAdamW::new(solo(), vars(DType::F32)?, p.clone())?
            .load(&file)
            .unwrap_err();
        assert_eq!(
            e.to_string().lines().next(),
            Some(
                format!(
                    "{} has 6 tensors, 4 expected: it was saved for parameters of another dtype \
                     (with f32 masters)",
                    file.display()
                )
                .as_str()
            )
        );
        // LeanAdamW's file is not a rank's share.
        let lean = dir.join("lean.safetensors");
        LeanAdamW::new(vars(DType::F32)?, p.clone())?.save(&lean)?;
        let e = ZeroAdamW::new(solo(), vars(DType::F32)?, p)?
            .load(&lean)
            .unwrap_err();
        assert!(
            e.to_string().starts_with(&format!(
                "{}: holds no ZeroAdamW state (no zero.rank)",
                lean.display()
            )),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
        Ok(())
    }

    /// Integer variables are left out, as candle's AdamW and LeanAdamW
    /// leave them: no state for them, the floats stepped as without them.
    #[test]
    fn an_integer_variable_is_left_out() -> Result<()> {
        let (a, b) = (vars(DType::F32)?, vars(DType::F32)?);
        let counter = Var::new(&[7u32, 9], &candle_core::Device::Cpu)?;
        let with = a.iter().cloned().chain([counter.clone()]).collect();
        let p = ParamsAdamW {
            lr: 0.1,
            ..Default::default()
        };
        let mut zero = ZeroAdamW::new(Arc::new(Comm::solo()), with, p.clone())?;
        // Moments of the 12 + 5 float elements only; f32 needs no master.
        assert_eq!(zero.state_bytes(), 2 * (12 + 5) * 4);
        let mut lean = LeanAdamW::new(b.clone(), p)?;
        for step in 0..3 {
            zero.step(&loss(&a, step)?.backward()?)?;
            lean.step(&loss(&b, step)?.backward()?)?;
        }
        assert_eq!(values(&a)?, values(&b)?);
        assert_eq!(counter.as_tensor().to_vec1::<u32>()?, [7, 9]);
        Ok(())
    }

    /// Two thread ranks: one rank's file of another step, or one rank
    /// without a file, and neither rank restores anything; the files of
    /// one step, and both do.
    #[test]
    fn ranks_restore_together_at_one_step_or_not_at_all() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("zero-agree-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let at = |rank: usize, step: usize| dir.join(format!("rank{rank}-step{step}.safetensors"));
        let p = ParamsAdamW {
            lr: 0.05,
            ..Default::default()
        };
        // Each rank's errors, and its step count after them and after the
        // good load. No assertion inside a rank: a rank that panicked would
        // leave the other waiting in a collective.
        let rank = |t: Threads| -> Result<(Vec<String>, [usize; 2])> {
            let comm = Arc::new(Comm::new(t));
            let r = comm.rank();
            let v = vars(DType::F32)?;
            let mut opt = ZeroAdamW::new(Arc::clone(&comm), v.clone(), p.clone())?;
            for step in 0..3 {
                opt.step(&loss(&v, step)?.backward()?)?;
                opt.save(at(r, step + 1))?;
            }
            let mut fresh = ZeroAdamW::new(comm, v, p.clone())?;
            let tries = [
                if r == 0 { at(0, 2) } else { at(1, 3) },
                if r == 0 {
                    at(0, 2)
                } else {
                    dir.join("missing")
                },
            ];
            let mut errors = Vec::new();
            for file in tries {
                match fresh.load(&file) {
                    Ok(()) => errors.push("loaded".to_string()),
                    // The first line: a backtrace may follow.
                    Err(e) => errors.push(e.to_string().lines().next().unwrap_or("").to_string()),
                }
            }
            let before = fresh.step_count();
            fresh.load(at(r, 2))?;
            Ok((errors, [before, fresh.step_count()]))
        };
        let got: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = Threads::world(2)
                .into_iter()
                .map(|t| s.spawn(move || rank(t)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let got = got.into_iter().collect::<Result<Vec<_>>>()?;
        let (p0, p3) = (at(0, 2), at(1, 3));
        assert_eq!(
            got[0].0,
            [
                format!(
                    "{}: not loaded: the state of step 2, but rank 1's is of step 3: every \
                     rank loads the state saved at the same step",
                    p0.display()
                ),
                format!(
                    "{}: not loaded: rank 1 of 2 could not load its state (its error is on \
                     that rank), and the ranks restore together or not at all",
                    p0.display()
                ),
            ]
        );
        assert_eq!(
            got[1].0[0],
            format!(
                "{}: not loaded: the state of step 3, but rank 0's is of step 2: every rank \
                 loads the state saved at the same step",
                p3.display()
            )
        );
        let missing = dir.join("missing");
        assert!(
            got[1].0[1].starts_with(&format!("{}: ", missing.display())),
            "{}",
            got[1].0[1]
        );
        for (errors, steps) in &got {
            assert_eq!(steps, &[0, 2], "{errors:?}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
        Ok(())
    }
}
