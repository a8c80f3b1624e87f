//! What a meter reads: bytes by category, a snapshot, a memory pool's own
//! figures.

use super::*;

/// The number of categories.
pub const CATEGORIES: usize = 7;

/// Bytes per category, indexed in the order of [`Category::ALL`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ByCategory(pub [u64; CATEGORIES]);

impl ByCategory {
    /// The bytes of one category.
    pub fn get(&self, category: Category) -> u64 {
        self.0[category.index()]
    }

    /// The sum over all categories.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    /// Pairs of category and bytes, in display order.
    pub fn iter(&self) -> impl Iterator<Item = (Category, u64)> + '_ {
        Category::ALL.iter().map(|&c| (c, self.get(c)))
    }

    /// Each category's bytes minus `base`'s, floored at zero.
    pub fn saturating_sub(&self, base: &ByCategory) -> ByCategory {
        let mut out = [0; CATEGORIES];
        for (i, slot) in out.iter_mut().enumerate() {
            *slot = self.0[i].saturating_sub(base.0[i]);
        }
        ByCategory(out)
    }
}

impl Serialize for ByCategory {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(Category::ALL.len()))?;
        for (c, b) in self.iter() {
            map.serialize_entry(c.name(), &b)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for ByCategory {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let map = std::collections::BTreeMap::<Category, u64>::deserialize(d)?;
        let mut out = ByCategory::default();
        for (c, b) in map {
            out.0[c.index()] = b;
        }
        Ok(out)
    }
}

/// What a meter reads at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemorySnapshot {
    /// Bytes live now, by category.
    pub current: ByCategory,
    /// The highest total since the last reset.
    pub peak: u64,
    /// The split by category at the moment the peak was reached.
    pub peak_by_category: ByCategory,
    /// The highest each category reached on its own since the last reset,
    /// each at its own moment (so they need not add up to `peak`).
    pub peak_each: ByCategory,
    /// The part of `current` that is host-resident (see [`Residency`]).
    pub host: ByCategory,
    /// The highest each category reached on the device, since the last reset.
    pub device_peak_each: ByCategory,
    /// The highest each category reached on the host, since the last reset.
    pub host_peak_each: ByCategory,
    /// Blocks (allocations) live now.
    pub live_blocks: u64,
    /// The most blocks live at once since the last reset.
    pub peak_blocks: u64,
    /// The highest device-resident total at one moment since the last
    /// reset: on the CPU, what is not tagged as the host's (see
    /// [`Residency`]); on a GPU, the pool's high-water mark.
    pub device_peak: u64,
    /// The CUDA memory pool's own figures, on a GPU; `None` on the CPU.
    pub pool: Option<PoolReading>,
}

/// What a CUDA memory pool says of itself: the analogues of
/// `torch.cuda.memory_allocated`, `max_memory_allocated` and
/// `memory_reserved`. On a GPU these stand beside the bytes counted by
/// category, as the check that every device buffer was counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolReading {
    /// Bytes handed out from the pool now.
    pub used: u64,
    /// The most handed out at once since the peak was last reset.
    pub used_high: u64,
    /// Bytes the pool holds from the driver, in use or cached for reuse.
    pub reserved: u64,
}

impl MemorySnapshot {
    /// Total bytes live now.
    pub fn current_total(&self) -> u64 {
        self.current.total()
    }
}
