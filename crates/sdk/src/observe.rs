//! The meter behind the toolkit's observer hook: what a technique says its
//! memory is for becomes the meter's [`Category`] and [`Residency`], and
//! its steps become a region's timeline marks.

use std::cell::RefCell;
use std::sync::Arc;

use candle_observe::{Kind, Observer, Place, Token};

use crate::meter::{restore_tags, swap_tags, Category, Meter, Residency};
use crate::plugin::Region;

fn category(kind: Kind) -> Category {
    match kind {
        Kind::Parameters => Category::Parameters,
        Kind::Activations => Category::Activations,
        Kind::Gradients => Category::Gradients,
        Kind::OptimizerState => Category::OptimizerState,
        Kind::Communication => Category::Communication,
        // The hook's kinds may grow; untagged memory is "other".
        _ => Category::Other,
    }
}

fn residency(place: Place) -> Residency {
    match place {
        Place::Device => Residency::Device,
        Place::Host => Residency::Host,
    }
}

/// Tags the toolkit's allocations by category and residency.
#[derive(Debug, Clone, Copy, Default)]
pub struct Tags;

impl Observer for Tags {
    fn enter(&self, kind: Kind, place: Place) -> Token {
        Token(swap_tags(category(kind), residency(place)))
    }

    fn leave(&self, token: Token) {
        restore_tags(token.0)
    }
}

/// Tags like [`Tags`] and marks each step on a region's timeline.
pub struct Marks<'a>(RefCell<&'a mut Region>);

impl<'a> Marks<'a> {
    /// Marks on `region`.
    pub fn new(region: &'a mut Region) -> Self {
        Self(RefCell::new(region))
    }
}

impl std::fmt::Debug for Marks<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Marks")
    }
}

impl Observer for Marks<'_> {
    fn enter(&self, kind: Kind, place: Place) -> Token {
        Tags.enter(kind, place)
    }

    fn leave(&self, token: Token) {
        Tags.leave(token)
    }

    fn mark(&self, label: &'static str) {
        self.0.borrow_mut().mark(label);
    }
}

/// Tags like [`Tags`] and takes the peak of each stretch between two of the
/// technique's marks (a segment's forward, a layer's backward): the peak of
/// a step moment by moment. A planner that draws each stretch's own line in
/// the batch sees a moment that will overtake the others at a larger batch
/// (where the line through the whole step's peaks cannot).
///
/// Each stretch is a peak frame of the meter ([`Meter::push_peak`]), closed
/// into the enclosing one at the next mark, so the enclosing region's peak
/// is the same as without it.
pub struct Phases {
    meter: Arc<dyn Meter>,
    peaks: RefCell<Vec<u64>>,
    open: bool,
}

impl Phases {
    /// Opens the first stretch.
    pub fn start(meter: Arc<dyn Meter>) -> Self {
        // Room for a deep model's marks, allocated before the frame opens.
        let peaks = Category::Other.scope(|| Vec::with_capacity(256));
        meter.push_peak();
        Self {
            meter,
            peaks: RefCell::new(peaks),
            open: true,
        }
    }

    /// Closes the stretch open now, and opens the next.
    fn close(&self) -> u64 {
        let peak = self.meter.snapshot().peak;
        self.meter.pop_peak();
        peak
    }

    /// Closes the last stretch: each stretch's peak, in bytes (absolute, as
    /// [`Meter::snapshot`]'s).
    pub fn finish(mut self) -> Vec<u64> {
        let last = self.close();
        self.open = false;
        let mut peaks = std::mem::take(&mut *self.peaks.borrow_mut());
        Category::Other.scope(|| peaks.push(last));
        peaks
    }
}

impl Drop for Phases {
    fn drop(&mut self) {
        // Abandoned by an error: the frame still closes into its region.
        if self.open {
            self.meter.pop_peak();
        }
    }
}

impl std::fmt::Debug for Phases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Phases")
            .field("peaks", &self.peaks)
            .finish()
    }
}

impl Observer for Phases {
    fn enter(&self, kind: Kind, place: Place) -> Token {
        Tags.enter(kind, place)
    }

    fn leave(&self, token: Token) {
        Tags.leave(token)
    }

    fn mark(&self, _label: &'static str) {
        let peak = self.close();
        Category::Other.scope(|| self.peaks.borrow_mut().push(peak));
        self.meter.push_peak();
    }
}
