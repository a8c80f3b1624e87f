//! f32 master weights behind a compute dtype.

use candle_core::{DType, Device, Result, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder, VarMap};

/// A model's f32 variables, handed to its layers cast to a compute dtype.
///
/// Build the model from [`var_builder`](Self::var_builder) for each step
/// (building a candle-nn model is a lookup and a cast per tensor, which is
/// what mixed precision does each step anyway): the casts are fresh from the
/// masters the optimizer just updated, and the graph from the loss reaches
/// the masters through them.
///
/// ```
/// use candle_amp::MasterWeights;
/// use candle_core::{DType, Device, Module, Tensor};
/// let dev = Device::Cpu;
/// let masters = MasterWeights::new(DType::BF16);
/// let layer = candle_nn::linear(4, 2, masters.var_builder(&dev))?;
/// let x = Tensor::ones((3, 4), DType::BF16, &dev)?;
/// let y = layer.forward(&x)?;
/// assert_eq!(y.dtype(), DType::BF16);
/// let grads = y.to_dtype(DType::F32)?.sum_all()?.backward()?;
/// for v in masters.vars() {
///     assert_eq!(v.dtype(), DType::F32);
///     assert_eq!(grads.get(v.as_tensor()).unwrap().dtype(), DType::F32);
/// }
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone)]
pub struct MasterWeights {
    map: VarMap,
    compute: DType,
}

impl std::fmt::Debug for MasterWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MasterWeights")
            .field("compute", &self.compute)
            .field("vars", &self.map.all_vars().len())
            .finish()
    }
}

impl MasterWeights {
    /// Empty masters; the first [`var_builder`](Self::var_builder) pass
    /// creates them in f32 with the layers' initialisers.
    pub fn new(compute: DType) -> Self {
        Self::from_varmap(VarMap::new(), compute)
    }

    /// Masters from an existing `VarMap` (loaded weights, say), which must
    /// hold f32 variables.
    pub fn from_varmap(map: VarMap, compute: DType) -> Self {
        Self { map, compute }
    }

    /// The compute dtype.
    pub fn compute_dtype(&self) -> DType {
        self.compute
    }

    /// The f32 variables in the order of their names: give these to the
    /// optimizer. A `VarMap`'s own order is a hash map's, another in each
    /// process; what goes by position (an optimizer's saved moments, the
    /// ranks' buckets and collectives) needs the same order every time.
    pub fn vars(&self) -> Vec<Var> {
        let data = self
            .map
            .data()
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut named: Vec<(&String, &Var)> = data.iter().collect();
        named.sort_unstable_by(|a, b| a.0.cmp(b.0));
        named.into_iter().map(|(_, var)| var.clone()).collect()
    }

    /// The `VarMap` of the masters (to save them, or to check gradients).
    pub fn varmap(&self) -> &VarMap {
        &self.map
    }

    /// A builder whose tensors are casts of the masters to the compute dtype
    /// (or to the dtype a layer asks for with `vb.to_dtype`, to keep its
    /// norms in f32, say), on `device`.
    pub fn var_builder(&self, device: &Device) -> VarBuilder<'static> {
        VarBuilder::from_backend(
            Box::new(Cast {
                map: self.map.clone(),
            }),
            self.compute,
            device.clone(),
        )
    }
}

struct Cast {
    map: VarMap,
}

impl SimpleBackend for Cast {
    fn get(&self, s: Shape, name: &str, h: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        let master = self.map.get(s, name, h, DType::F32, dev)?;
        if master.dtype() != DType::F32 {
            candle_core::bail!(
                "master weight {name} is {:?}: master weights must be f32",
                master.dtype()
            );
        }
        // The dtype the layer asks for: the builder's, the compute dtype,
        // unless a layer keeps some weights in another (`vb.to_dtype`).
        // Differentiable: the gradient of the cast flows to the master.
        master.to_dtype(dtype)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, _: &Device) -> Result<Tensor> {
        let data = self.map.data().lock().unwrap_or_else(|e| e.into_inner());
        match data.get(name) {
            Some(v) => v.as_tensor().to_dtype(dtype),
            None => candle_core::bail!("no master weight named {name}"),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        SimpleBackend::contains_tensor(&self.map, name)
    }
}
