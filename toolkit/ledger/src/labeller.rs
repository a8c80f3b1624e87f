//! Names for graph nodes, given as a forward makes them.

use std::cell::RefCell;
use std::collections::HashMap;
use std::time::{Duration, Instant};

use candle_core::{Tensor, TensorId};
use candle_custom_grad::kept::Recording;

/// Where a node was made: a layer (if any) and a part of it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Label {
    /// The layer, such as a transformer block's index.
    pub layer: Option<usize>,
    /// The part, such as `"attention"` or `"mlp.fc"`.
    pub part: String,
}

/// Labels graph nodes as a forward makes them, times each labelled part,
/// and while it lives notes what the custom backwards of
/// `candle-custom-grad` (the toolkit's fused layers, tiled attention) keep
/// beside the graph. A disabled labeller (the [`Default`]) does nothing
/// and costs nothing, so a model can take one always. Create it on the
/// thread that runs the forward, just before it.
#[derive(Debug, Default)]
pub struct Labeller {
    map: Option<RefCell<HashMap<TensorId, Label>>>,
    kept: Option<Recording>,
    clock: Option<RefCell<Clock>>,
}

/// The time of each labelled part: from the end of the previous label
/// (its graph walk excluded) to the start of this one.
#[derive(Debug)]
struct Clock {
    since: Instant,
    spans: Vec<(Label, Duration)>,
}

impl Labeller {
    /// A labeller that labels, times each part, and notes what custom
    /// backwards keep.
    pub fn new() -> Self {
        Self {
            map: Some(RefCell::new(HashMap::new())),
            kept: Some(Recording::start()),
            clock: Some(RefCell::new(Clock {
                since: Instant::now(),
                spans: Vec::new(),
            })),
        }
    }

    /// A labeller that only notes what custom backwards keep: a ledger's
    /// totals without the cost of labels (a few bytes per custom
    /// operation rather than a map entry per node).
    pub fn unlabelled() -> Self {
        Self {
            map: None,
            kept: Some(Recording::start()),
            clock: None,
        }
    }

    /// Each labelled part's forward time, in order: the time from the
    /// previous label (or the labeller's creation) to this one, without
    /// the labeller's own work. On a device that computes asynchronously
    /// (a GPU) it is the time to queue the work, not to do it.
    pub fn times(&self) -> Vec<(Label, Duration)> {
        self.clock
            .as_ref()
            .map(|c| c.borrow().spans.clone())
            .unwrap_or_default()
    }

    /// What the custom backward that made `t` keeps beside the graph.
    pub(crate) fn kept_by(&self, t: &Tensor) -> Vec<Tensor> {
        self.kept.as_ref().map(|k| k.kept_by(t)).unwrap_or_default()
    }

    /// Whether it records.
    pub fn is_enabled(&self) -> bool {
        self.map.is_some()
    }

    /// Gives `layer` and `part` to `t` and to every node of its graph not
    /// labelled yet (what was made since the previous label), and returns
    /// `t`. Walking the graph at each label costs time proportional to the
    /// graph: fine for a ledger, and skipped when disabled.
    pub fn label(&self, t: Tensor, layer: Option<usize>, part: &str) -> Tensor {
        if let Some(clock) = &self.clock {
            let mut clock = clock.borrow_mut();
            let spent = clock.since.elapsed();
            clock.spans.push((
                Label {
                    layer,
                    part: part.to_string(),
                },
                spent,
            ));
        }
        if let Some(map) = &self.map {
            let mut map = map.borrow_mut();
            for node in t.sorted_nodes() {
                if !node.is_variable() {
                    map.entry(node.id()).or_insert_with(|| Label {
                        layer,
                        part: part.to_string(),
                    });
                }
            }
        }
        if let Some(clock) = &self.clock {
            clock.borrow_mut().since = Instant::now();
        }
        t
    }

    /// The label of `t`, if it has one.
    pub fn get(&self, t: &Tensor) -> Option<Label> {
        self.map.as_ref()?.borrow().get(&t.id()).cloned()
    }
}
