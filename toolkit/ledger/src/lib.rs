//! What a candle graph holds for its backward, tensor by tensor.
//!
//! candle keeps every intermediate tensor of an expression that leads to a
//! variable until the result is dropped: that is the activation memory of
//! training. This crate lists it. A model's forward [`Labeller::label`]s
//! each part it computes (`layer 3, "attention"`); every graph node made
//! since the last label gets that label. After the forward,
//! [`Ledger::of`] walks the graph from the loss (candle's own
//! `sorted_nodes`) and records each held tensor once per storage (views
//! such as reshapes and transposes share their parent's bytes): its label,
//! shape, dtype and bytes. Sums per layer and per part are the terms a
//! formula such as Korthikanti et al.'s `s·b·h·(34 + 5·a·s/h)` predicts,
//! measured instead of assumed: JAX's `print_saved_residuals` for candle.
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! use candle_ledger::{Labeller, Ledger};
//! let dev = Device::Cpu;
//! let w = Var::new(&[[1f32, 2.0], [3.0, 4.0]], &dev)?;
//! let x = Tensor::new(&[[1f32, 1.0]; 8], &dev)?;
//! let labels = Labeller::new();
//! let h = labels.label(x.matmul(w.as_tensor())?, Some(0), "matmul");
//! let y = labels.label(h.tanh()?, Some(0), "tanh");
//! let loss = labels.label(y.sum_all()?, None, "loss");
//! let ledger = Ledger::of(&loss, &labels)?;
//! // The product and the tanh's output, 8 x 2 f32 each, and the scalar loss.
//! assert_eq!(ledger.total_bytes(), 64 + 64 + 4);
//! assert_eq!(ledger.bytes_of(Some(0), "tanh"), 64);
//! # Ok::<(), candle_core::Error>(())
//! ```
#![warn(missing_docs)]

mod labeller;
mod storage;

use std::collections::{BTreeMap, HashMap, HashSet};

use candle_core::{DType, Result, Tensor};

pub use labeller::{Label, Labeller};

/// One storage the graph holds.
#[derive(Debug, Clone, PartialEq)]
pub struct Held {
    /// What made it, as labelled; `None` for a node made outside any label.
    pub label: Option<Label>,
    /// The shape of the node that allocated the storage (of its views, the
    /// first seen when none is labelled).
    pub shape: Vec<usize>,
    /// Its element type.
    pub dtype: DType,
    /// Bytes of the storage: exact on the CPU, the viewed elements elsewhere.
    pub bytes: u64,
    /// Graph nodes on this storage (a tensor and its views).
    pub nodes: usize,
}

/// Every tensor a graph holds for its backward, once per storage.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    /// The storages, from the root back to the leaves.
    pub held: Vec<Held>,
}

impl Ledger {
    /// The tensors `root`'s graph holds: every node that leads to a variable,
    /// one entry per storage, and what the toolkit's custom backwards keep
    /// beside the graph (noted while `labels` lived, if it records).
    /// Variables and views of them (a transposed weight, a slice of a
    /// position table) are parameters, not listed. Tensors an operation
    /// holds that lead to no variable (a constant mask, integer indices)
    /// are not graph nodes and are not listed either.
    ///
    /// A `root` with no graph behind it is an error, not an empty ledger:
    /// a checkpointed or direct step (`candle-checkpoint`) holds its
    /// tensors outside candle's graph, where the ledger cannot see them.
    ///
    /// ```
    /// use candle_core::{Device, Tensor, Var};
    /// use candle_ledger::{Labeller, Ledger};
    /// let w = Var::new(&[1f32, 2.0], &Device::Cpu)?;
    /// let loss = w.as_tensor().sqr()?.sum_all()?;
    /// // The square (two f32) and the loss (one): `w` is a parameter.
    /// assert_eq!(Ledger::of(&loss, &Labeller::unlabelled())?.total_bytes(), 12);
    /// let err = Ledger::of(&loss.detach(), &Labeller::unlabelled()).unwrap_err();
    /// assert!(err.to_string().contains("no graph"));
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn of(root: &Tensor, labels: &Labeller) -> Result<Self> {
        let nodes = root.sorted_nodes();
        if nodes.is_empty() {
            candle_core::bail!(
                "the tensor has no graph that leads to a variable, so nothing is held for a \
                 backward that the ledger can list; a checkpointed or direct step \
                 (candle-checkpoint) keeps its tensors outside candle's graph: count those \
                 with a counting global allocator (as this workspace's tests do with \
                 candle-toolkit-alloc-count)"
            );
        }
        let parameters: HashSet<usize> = nodes
            .iter()
            .filter(|n| n.is_variable())
            .map(|n| storage::identity_and_bytes(n).0)
            .collect();
        let mut ledger = Collect {
            parameters,
            held: Vec::new(),
            index_of: HashMap::new(),
        };
        for node in nodes.iter().filter(|n| !n.is_variable()) {
            let label = labels.get(node);
            ledger.add(node, &label);
            for kept in labels.kept_by(node) {
                ledger.add(&kept, &label);
            }
        }
        Ok(Self { held: ledger.held })
    }

    /// All bytes held.
    pub fn total_bytes(&self) -> u64 {
        self.held.iter().map(|h| h.bytes).sum()
    }

    /// Bytes held under `layer` and `part`.
    pub fn bytes_of(&self, layer: Option<usize>, part: &str) -> u64 {
        self.held
            .iter()
            .filter(|h| {
                h.label
                    .as_ref()
                    .is_some_and(|l| l.layer == layer && l.part == part)
            })
            .map(|h| h.bytes)
            .sum()
    }

    /// Bytes per layer (`None`: outside any layer, or unlabelled).
    pub fn by_layer(&self) -> BTreeMap<Option<usize>, u64> {
        let mut sums = BTreeMap::new();
        for h in &self.held {
            *sums
                .entry(h.label.as_ref().and_then(|l| l.layer))
                .or_default() += h.bytes;
        }
        sums
    }

    /// Bytes and storages per part, over all layers (`"unlabelled"` for
    /// nodes made outside any label).
    pub fn by_part(&self) -> BTreeMap<String, (u64, usize)> {
        let mut sums: BTreeMap<String, (u64, usize)> = BTreeMap::new();
        for h in &self.held {
            let part = h.label.as_ref().map_or("unlabelled", |l| l.part.as_str());
            let e = sums.entry(part.to_string()).or_default();
            e.0 += h.bytes;
            e.1 += 1;
        }
        sums
    }

    /// The entries of one layer, in graph order.
    pub fn layer(&self, layer: usize) -> impl Iterator<Item = &Held> {
        self.held
            .iter()
            .filter(move |h| h.label.as_ref().and_then(|l| l.layer) == Some(layer))
    }
}

/// A ledger being built: one entry per storage.
struct Collect {
    parameters: HashSet<usize>,
    held: Vec<Held>,
    index_of: HashMap<usize, usize>,
}

impl Collect {
    fn add(&mut self, t: &Tensor, label: &Option<Label>) {
        let (key, bytes) = storage::identity_and_bytes(t);
        if self.parameters.contains(&key) {
            return;
        }
        if let Some(&i) = self.index_of.get(&key) {
            let entry = &mut self.held[i];
            entry.nodes += 1;
            // Off the CPU a storage's size is read from its nodes' views:
            // the allocating node, seen last, is the largest.
            entry.bytes = entry.bytes.max(bytes);
            // Nodes come from the root back: of a storage's nodes the last
            // seen is the one that allocated it (the others are its views,
            // made later), and the storage belongs to its part.
            if label.is_some() {
                entry.label.clone_from(label);
                entry.shape = t.dims().to_vec();
            }
            return;
        }
        self.index_of.insert(key, self.held.len());
        self.held.push(Held {
            label: label.clone(),
            shape: t.dims().to_vec(),
            dtype: t.dtype(),
            bytes,
            nodes: 1,
        });
    }
}
