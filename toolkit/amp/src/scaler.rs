//! Dynamic loss scaling with torch.amp's protocol.

use candle_core::backprop::GradStore;
use candle_core::{bail, DType, Result, Tensor, Var};
use candle_nn::Optimizer;
use serde::{Deserialize, Serialize};

use crate::InfCheck;

/// The settings of a [`GradScaler`]; the defaults are torch.amp's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields, default)]
pub struct ScalerConfig {
    /// The first scale the loss is multiplied by (positive).
    pub init_scale: f64,
    /// What the scale is multiplied by after `growth_interval` clean steps
    /// (above 1).
    pub growth_factor: f64,
    /// What the scale is multiplied by after a step with inf or NaN (above
    /// 0, below 1).
    pub backoff_factor: f64,
    /// Clean steps in a row before the scale grows (at least 1).
    #[cfg_attr(feature = "schemars", schemars(range(min = 1)))]
    pub growth_interval: u32,
}

impl ScalerConfig {
    /// An error naming the setting that torch.amp would refuse.
    pub fn validate(&self) -> Result<()> {
        if !(self.init_scale.is_finite() && self.init_scale > 0.0) {
            bail!(
                "init_scale is {}: it must be a positive finite number",
                self.init_scale
            );
        }
        if !(self.growth_factor.is_finite() && self.growth_factor > 1.0) {
            bail!(
                "growth_factor is {}: it must be a finite number above 1",
                self.growth_factor
            );
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            bail!(
                "backoff_factor is {}: it must be above 0 and below 1",
                self.backoff_factor
            );
        }
        if self.growth_interval == 0 {
            bail!("growth_interval is 0: it must be at least 1");
        }
        Ok(())
    }
}

impl Default for ScalerConfig {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

/// What [`GradScaler::step`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepOutcome {
    /// The optimizer stepped.
    Stepped,
    /// The gradients held an inf or NaN: the optimizer did not step.
    Skipped,
}

/// What [`GradScaler::update`] did to the scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleChange {
    /// Unchanged.
    Kept,
    /// Multiplied by the growth factor after enough clean steps.
    Grew,
    /// Multiplied by the backoff factor after an inf or NaN.
    BackedOff,
}

/// Everything a [`GradScaler`] needs to resume: torch's `state_dict`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScalerState {
    /// The settings.
    pub config: ScalerConfig,
    /// The current scale.
    pub scale: f64,
    /// Clean steps in a row since the scale last changed.
    pub growth_tracker: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Since the last update: nothing done yet.
    Ready,
    /// Gradients unscaled, inf/NaN known.
    Unscaled { found_inf: bool },
    /// The optimizer stepped (or skipped).
    Stepped { found_inf: bool },
}

/// A dynamic loss scaler for f16 training, used as `torch.amp.GradScaler`:
///
/// ```text
/// let mut grads = scaler.scale(&loss)?.backward()?;
/// scaler.unscale(&mut grads, &vars)?;      // optional: to clip first
/// scaler.step(&mut optimizer, &mut grads, &vars)?;
/// scaler.update()?;
/// ```
///
/// `step` unscales if `unscale` was not called; calling `unscale` twice in a
/// step, stepping twice, or updating before any inf check is an error, not a
/// silently wrong scale.
///
/// ```
/// use candle_amp::{GradScaler, ScaleChange, ScalerConfig, StepOutcome};
/// use candle_core::{Device, Var};
/// use candle_nn::{Optimizer, SGD};
/// let w = Var::new(&[1f32, 2.0], &Device::Cpu)?;
/// let mut sgd = SGD::new(vec![w.clone()], 0.5)?;
/// let mut scaler = GradScaler::new(ScalerConfig { growth_interval: 1, ..Default::default() })?;
///
/// let loss = w.as_tensor().sum_all()?; // gradient [1, 1]
/// let mut grads = scaler.scale(&loss)?.backward()?;
/// assert_eq!(scaler.step(&mut sgd, &mut grads, &[w.clone()])?, StepOutcome::Stepped);
/// assert_eq!(w.to_vec1::<f32>()?, [0.5, 1.5]); // unscaled before the step
/// assert_eq!(scaler.update()?, ScaleChange::Grew);
/// assert_eq!(scaler.scale_factor(), 131072.0);
///
/// let loss = (w.as_tensor() * f64::INFINITY)?.sum_all()?;
/// let mut grads = scaler.scale(&loss)?.backward()?;
/// assert_eq!(scaler.step(&mut sgd, &mut grads, &[w.clone()])?, StepOutcome::Skipped);
/// assert_eq!(w.to_vec1::<f32>()?, [0.5, 1.5]); // untouched
/// assert_eq!(scaler.update()?, ScaleChange::BackedOff);
/// assert_eq!(scaler.scale_factor(), 65536.0);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct GradScaler {
    config: ScalerConfig,
    scale: f64,
    growth_tracker: u32,
    stage: Stage,
}

impl GradScaler {
    /// A scaler at `config.init_scale`; an error for settings torch.amp
    /// refuses ([`ScalerConfig::validate`]).
    pub fn new(config: ScalerConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self {
            scale: config.init_scale,
            config,
            growth_tracker: 0,
            stage: Stage::Ready,
        })
    }

    /// The current scale.
    pub fn scale_factor(&self) -> f64 {
        self.scale
    }

    /// Clean steps in a row since the scale last changed.
    pub fn growth_tracker(&self) -> u32 {
        self.growth_tracker
    }

    /// `loss * scale`: call `backward` on this. The loss must not be f16:
    /// the default scale, 65536, is past f16's largest value (65504), so
    /// compute the loss in f32 (cast the logits), as autocast does.
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor> {
        if loss.dtype() == DType::F16 {
            bail!(
                "the loss is f16, in which a scale of {} overflows: compute the loss in f32",
                self.scale
            );
        }
        loss * self.scale
    }

    /// Divides the gradients of `vars` by the scale and says whether any of
    /// them holds an inf or NaN. Once per step: a second call before
    /// [`update`](Self::update) is an error.
    ///
    /// `vars` are all the variables the optimizer steps: afterwards `grads`
    /// holds their unscaled gradients only, so that no still-scaled entry
    /// can reach the optimizer. Gradients must be f32, f64 or bf16: f16
    /// gradients would lose in the division the small values the scale
    /// kept, so, as torch.amp, they are refused (keep f32 master weights,
    /// `MasterWeights`). A store with no gradient of any of `vars` is an
    /// error too, as torch's "no inf checks were recorded": the wrong
    /// variables would otherwise step nothing while the scale grew.
    ///
    /// The check runs on the device: each gradient times zero is summed
    /// (inf and NaN make NaN), the sums are added up there, and one number
    /// is read back.
    pub fn unscale(&mut self, grads: &mut GradStore, vars: &[Var]) -> Result<bool> {
        if self.stage != Stage::Ready {
            bail!("unscale was already called (or the optimizer stepped) since the last update");
        }
        if let Some(v) = vars.iter().find(|v| {
            grads
                .get(v.as_tensor())
                .is_some_and(|g| g.dtype() == DType::F16)
        }) {
            bail!(
                "a gradient of shape {:?} is f16: unscaling it would flush what the scale kept; keep f32 master weights",
                v.dims()
            );
        }
        let inv = 1.0 / self.scale;
        let mut check = InfCheck::default();
        let mut unscaled = GradStore::default();
        for var in vars {
            if let Some(g) = grads.get(var.as_tensor()) {
                let g = g.affine(inv, 0.0)?;
                check.add(&g)?;
                unscaled.insert(var.as_tensor(), g);
            }
        }
        // As torch's "No inf checks were recorded": stepping on an empty
        // store would drop every gradient and grow the scale unchecked.
        let Some(found_inf) = check.found()? else {
            bail!(
                "none of the {} variables given has a gradient in the store: pass the \
                 variables the loss was computed from (a MasterWeights' vars once the model \
                 is built)",
                vars.len()
            );
        };
        *grads = unscaled;
        self.stage = Stage::Unscaled { found_inf };
        Ok(found_inf)
    }

    /// Steps `optimizer` with the unscaled gradients, unscaling them first if
    /// [`unscale`](Self::unscale) was not called, unless they hold an inf or
    /// NaN. Does not change the scale: call [`update`](Self::update) next.
    /// Its unscaling's errors are [`unscale`](Self::unscale)'s.
    pub fn step<O: Optimizer>(
        &mut self,
        optimizer: &mut O,
        grads: &mut GradStore,
        vars: &[Var],
    ) -> Result<StepOutcome> {
        let found_inf = match self.stage {
            Stage::Ready => self.unscale(grads, vars)?,
            Stage::Unscaled { found_inf } => found_inf,
            Stage::Stepped { .. } => bail!("step was already called since the last update"),
        };
        self.stage = Stage::Stepped { found_inf };
        if found_inf {
            return Ok(StepOutcome::Skipped);
        }
        optimizer.step(grads)?;
        Ok(StepOutcome::Stepped)
    }

    /// Records the inf check of an optimizer that holds its own gradients,
    /// in place of [`unscale`](Self::unscale): a ZeRO optimizer unscales its
    /// blocks of the gradients and agrees over the ranks whether any holds
    /// an inf or NaN (`candle_distributed::ZeroAdamW::unscale_gradients`),
    /// as torch's `scaler.unscale_(optimizer)` does. Step that optimizer
    /// only when `found_inf` is false, then call [`update`](Self::update).
    /// Once per step: an error after [`unscale`](Self::unscale) or
    /// [`step`](Self::step).
    pub fn record_inf_check(&mut self, found_inf: bool) -> Result<()> {
        if self.stage != Stage::Ready {
            bail!(
                "an inf check was already made (unscale, step or record_inf_check) since the \
                 last update"
            );
        }
        // The optimizer steps itself: `step` would step it a second time.
        self.stage = Stage::Stepped { found_inf };
        Ok(())
    }

    /// Backs the scale off if this step found an inf or NaN, grows it after
    /// `growth_interval` clean steps, and starts the next step. An error if
    /// neither [`unscale`](Self::unscale) nor [`step`](Self::step) ran since
    /// the last update.
    pub fn update(&mut self) -> Result<ScaleChange> {
        let found_inf = match self.stage {
            Stage::Ready => bail!("update needs an inf check first: call unscale or step"),
            Stage::Unscaled { found_inf } | Stage::Stepped { found_inf } => found_inf,
        };
        self.stage = Stage::Ready;
        if found_inf {
            self.scale *= self.config.backoff_factor;
            self.growth_tracker = 0;
            return Ok(ScaleChange::BackedOff);
        }
        self.growth_tracker = self.growth_tracker.saturating_add(1);
        if self.growth_tracker >= self.config.growth_interval {
            self.growth_tracker = 0;
            // As torch: the scale grows only to a finite value.
            let grown = self.scale * self.config.growth_factor;
            if grown.is_finite() {
                self.scale = grown;
                return Ok(ScaleChange::Grew);
            }
        }
        Ok(ScaleChange::Kept)
    }

    /// The state to save.
    pub fn state(&self) -> ScalerState {
        ScalerState {
            config: self.config,
            scale: self.scale,
            growth_tracker: self.growth_tracker,
        }
    }

    /// A scaler resumed from a saved state; an error for a state torch.amp
    /// could not have saved.
    pub fn from_state(state: ScalerState) -> Result<Self> {
        state.config.validate()?;
        if !(state.scale.is_finite() && state.scale > 0.0) {
            bail!(
                "scale is {}: it must be a positive finite number",
                state.scale
            );
        }
        Ok(Self {
            config: state.config,
            scale: state.scale,
            growth_tracker: state.growth_tracker,
            stage: Stage::Ready,
        })
    }
}
