//! Saving and loading optimizer state as safetensors.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{bail, DType, Device, Result, Tensor, Var};
use candle_nn::ParamsAdamW;

/// Writes an AdamW state to `path` (safetensors): the step count, the
/// hyper-parameters and `tensors` (moments, masters) by name.
pub fn save_state(
    path: &Path,
    step: usize,
    params: &ParamsAdamW,
    tensors: impl IntoIterator<Item = (String, Tensor)>,
) -> Result<()> {
    let mut map: HashMap<String, Tensor> = tensors.into_iter().collect();
    map.insert(
        "step".into(),
        Tensor::new(&[step as u64 as f64], &Device::Cpu)?,
    );
    map.insert(
        "hyper".into(),
        Tensor::new(
            &[
                params.lr,
                params.beta1,
                params.beta2,
                params.eps,
                params.weight_decay,
            ],
            &Device::Cpu,
        )?,
    );
    candle_core::safetensors::save(&map, path)
}

/// An AdamW state that [`save_state`] wrote, being restored.
#[derive(Debug)]
pub struct StateFile {
    /// The file, as its errors name it.
    path: std::path::PathBuf,
    step: usize,
    params: ParamsAdamW,
    tensors: HashMap<String, Tensor>,
}

impl StateFile {
    /// Reads `path`.
    pub fn read(path: &Path) -> Result<Self> {
        let mut tensors = candle_core::safetensors::load(path, &Device::Cpu)
            .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", path.display())))?;
        let (Some(step), Some(hyper)) = (tensors.remove("step"), tensors.remove("hyper")) else {
            bail!("{} holds no AdamW state (no step or hyper)", path.display());
        };
        let step = step.to_dtype(DType::F64)?.to_vec1::<f64>()?;
        let h = hyper.to_dtype(DType::F64)?.to_vec1::<f64>()?;
        if step.len() != 1 || h.len() != 5 {
            bail!("{}: malformed AdamW state", path.display());
        }
        // A count of steps: whole, and at most 2^53, where an f64 still
        // holds every integer.
        let count = step[0];
        if !(count >= 0.0 && count.fract() == 0.0 && count <= (1u64 << 53) as f64) {
            bail!(
                "{}: the saved step is {count}; a step count is a whole number from 0 to 2^53",
                path.display()
            );
        }
        Ok(Self {
            path: path.to_path_buf(),
            step: count as usize,
            params: ParamsAdamW {
                lr: h[0],
                beta1: h[1],
                beta2: h[2],
                eps: h[3],
                weight_decay: h[4],
            },
            tensors,
        })
    }

    /// The step count saved.
    pub fn step(&self) -> usize {
        self.step
    }

    /// The hyper-parameters saved.
    pub fn params(&self) -> &ParamsAdamW {
        &self.params
    }

    /// Takes the tensor `name` out, for what an optimizer saves beside its
    /// moments (ZeRO's rank, say); `None` where there is none.
    pub fn take(&mut self, name: &str) -> Option<Tensor> {
        self.tensors.remove(name)
    }

    /// Checks, before anything is restored, that the file holds a tensor
    /// for each `(name, variable)` of the shape of the variable, and no
    /// other: a load that checks first then fails on nothing it can see,
    /// so it does not leave an optimizer half restored.
    pub fn check<'a>(&self, expected: impl IntoIterator<Item = (String, &'a Var)>) -> Result<()> {
        let file = self.path.display();
        let mut seen = 0;
        for (name, var) in expected {
            self.matching(&name, var)?;
            seen += 1;
        }
        if seen != self.tensors.len() {
            let mut extra: Vec<&str> = self
                .tensors
                .keys()
                .map(String::as_str)
                .filter(|k| !k.starts_with("m.") && !k.starts_with("v."))
                .collect();
            extra.sort();
            // Masters where this optimizer keeps none: parameters of another
            // dtype, not more of them.
            let why = if !extra.is_empty() && extra.iter().all(|k| k.starts_with("master.")) {
                "it was saved for parameters of another dtype (with f32 masters)"
            } else {
                "it was saved for more variables than this optimizer has"
            };
            bail!(
                "{file} has {} tensors, {seen} expected: {why}",
                self.tensors.len()
            );
        }
        Ok(())
    }

    /// The tensor `name`, an error unless it is there with `var`'s shape.
    fn matching(&self, name: &str, var: &Var) -> Result<&Tensor> {
        let file = self.path.display();
        let Some(t) = self.tensors.get(name) else {
            bail!("{file} has no {name}: was it saved for the same variables?");
        };
        if t.dims() != var.dims() {
            bail!(
                "{file}: its {name} has shape {:?}, this optimizer's {:?}: was it saved for the \
                 same variables?",
                t.dims(),
                var.dims()
            );
        }
        Ok(t)
    }

    /// Sets `into` from the tensor `name`, which must match its shape.
    pub fn restore(&mut self, name: &str, into: &Var) -> Result<()> {
        into.set(
            &self
                .matching(name, into)?
                .to_dtype(into.dtype())?
                .to_device(into.device())?,
        )?;
        self.tensors.remove(name);
        Ok(())
    }

    /// An error if tensors are left over (saved for more variables).
    pub fn finish(self) -> Result<()> {
        if !self.tensors.is_empty() {
            let mut extra: Vec<_> = self.tensors.into_keys().collect();
            extra.sort();
            bail!(
                "{} has tensors for variables this optimizer lacks: {}",
                self.path.display(),
                extra.join(", ")
            );
        }
        Ok(())
    }
}
