//! The meter behind the toolkit's observer hook: what a technique says its
//! memory is for becomes the meter's [`Category`] and [`Residency`], and
//! its steps become a region's timeline marks.

use std::cell::RefCell;

use candle_observe::{Kind, Observer, Place, Token};

use crate::meter::{restore_tags, swap_tags, Category, Residency};
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
