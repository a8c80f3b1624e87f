//! Gradient stores: summing, and checking that none is missing.

use candle_core::backprop::GradStore;
use candle_core::{bail, Result, Tensor, Var};
use candle_nn::VarMap;

/// Adds the gradients of `vars` found in `from` to `into` (detached).
pub fn accumulate(into: &mut GradStore, from: &GradStore, vars: &[Var]) -> Result<()> {
    for var in vars {
        if let Some(g) = from.get(var.as_tensor()) {
            add_grad(into, var, g.detach())?;
        }
    }
    Ok(())
}

/// Adds `g` to `var`'s gradient in `store`, or makes it the gradient.
pub fn add_grad(store: &mut GradStore, var: &Var, g: Tensor) -> Result<()> {
    let total = match store.remove(var.as_tensor()) {
        Some(prev) => (prev + g)?,
        None => g,
    };
    store.insert(var.as_tensor(), total);
    Ok(())
}

/// The variables of `map` with their names, sorted by name.
pub fn named_vars(map: &VarMap) -> Vec<(String, Var)> {
    let data = map.data().lock().unwrap_or_else(|e| e.into_inner());
    let mut vars: Vec<_> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars
}

/// The names of the variables of `map` that have no gradient in `grads`,
/// sorted.
pub fn missing_grads(map: &VarMap, grads: &GradStore) -> Vec<String> {
    named_vars(map)
        .into_iter()
        .filter(|(_, v)| v.dtype().is_float() && grads.get(v.as_tensor()).is_none())
        .map(|(name, _)| name)
        .collect()
}

/// An error naming every float variable of `map` without a gradient in
/// `grads`: a checkpointed function that used a variable not passed in, a
/// layer left out of the backward, or a candle-nn layer whose fused kernel
/// has no backward (its error says which), shows here instead of training
/// silently without it.
///
/// ```
/// use candle_checkpoint::ensure_grads;
/// use candle_core::{backprop::GradStore, DType, Device};
/// use candle_nn::{VarBuilder, VarMap};
/// let map = VarMap::new();
/// let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
/// let _ = candle_nn::linear(2, 2, vb.pp("fc"))?;
/// let err = ensure_grads(&map, &GradStore::default()).unwrap_err();
/// // (candle appends a backtrace when RUST_BACKTRACE is set)
/// assert!(err.to_string().starts_with("2 variable(s) got no gradient: fc.bias, fc.weight"));
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn ensure_grads(map: &VarMap, grads: &GradStore) -> Result<()> {
    let missing = missing_grads(map, grads);
    if !missing.is_empty() {
        bail!(
            "{} variable(s) got no gradient: {} (candle-nn's fused LayerNorm on contiguous \
             input, ops::rms_norm and rotary_emb::rope have no backward and silently drop the \
             graph: candle-lean-nn's LeanLayerNorm, rms_norm and rope have one)",
            missing.len(),
            missing.join(", ")
        );
    }
    Ok(())
}
