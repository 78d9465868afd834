//! Endpoint slots: small integers that name an endpoint within one pool.
//!
//! The occupancy index, load accounting and policies address endpoints by
//! slot so their per-endpoint state is a plain vector and a bitset, not a map
//! of strings. [`Slots`] hands slots out by endpoint name and reuses freed
//! ones, so slot numbers stay dense as pods come and go.

use std::collections::HashMap;

/// An endpoint's slot in one pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Slot(pub u32);

impl Slot {
    /// The slot as a vector index.
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Assigns slots to endpoint names, reusing the lowest freed slot first.
#[derive(Debug, Default)]
pub struct Slots {
    by_name: HashMap<String, Slot>,
    free: Vec<Slot>,
    next: u32,
}

impl Slots {
    /// The slot of `name`, assigning one if it has none.
    pub fn assign(&mut self, name: &str) -> Slot {
        if let Some(&slot) = self.by_name.get(name) {
            return slot;
        }
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                self.next += 1;
                Slot(self.next - 1)
            }
        };
        self.by_name.insert(name.to_owned(), slot);
        slot
    }

    /// The slot of `name`, if it has one.
    pub fn get(&self, name: &str) -> Option<Slot> {
        self.by_name.get(name).copied()
    }

    /// Frees the slot of `name` and returns it. The caller must clear the
    /// slot's state (index entries, load) before it is reused.
    pub fn release(&mut self, name: &str) -> Option<Slot> {
        let slot = self.by_name.remove(name)?;
        self.free.push(slot);
        // Lowest first, so slot numbers (and bitsets) stay small.
        self.free.sort_unstable_by(|a, b| b.cmp(a));
        Some(slot)
    }

    /// How many names hold a slot.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Whether no name holds a slot.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_stable_and_reused_lowest_first() {
        let mut s = Slots::default();
        assert_eq!(s.assign("a"), Slot(0));
        assert_eq!(s.assign("b"), Slot(1));
        assert_eq!(s.assign("c"), Slot(2));
        assert_eq!(s.assign("a"), Slot(0));
        assert_eq!(s.release("c"), Some(Slot(2)));
        assert_eq!(s.release("a"), Some(Slot(0)));
        assert_eq!(s.release("a"), None);
        assert_eq!(s.assign("d"), Slot(0));
        assert_eq!(s.assign("e"), Slot(2));
        assert_eq!(s.assign("f"), Slot(3));
        assert_eq!(s.get("b"), Some(Slot(1)));
        assert_eq!(s.len(), 4);
    }
}
