//! A least-recently-used set of block hashes with O(1) operations.
//!
//! Used where kvroute has to model a cache it cannot see: a router's memory
//! of where it sent which prefix (approximate mode), and the replay
//! benchmark's replicas. Entries live in a slab with index links, so there is
//! one allocation per growth step, not per entry.

use std::collections::HashMap;

use foldhash::fast::RandomState;

const NIL: u32 = u32::MAX;

#[derive(Clone, Debug)]
struct Node {
    key: u64,
    prev: u32,
    next: u32,
}

/// An LRU-ordered set of `u64` keys.
#[derive(Clone, Debug, Default)]
pub struct Lru {
    map: HashMap<u64, u32, RandomState>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    /// Most recently used.
    head: Option<u32>,
    /// Least recently used.
    tail: Option<u32>,
}

impl Lru {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Whether `key` is held (does not change its recency).
    pub fn contains(&self, key: u64) -> bool {
        self.map.contains_key(&key)
    }

    /// Marks `key` most recently used, inserting it if absent. Returns
    /// whether it was already present.
    pub fn touch(&mut self, key: u64) -> bool {
        if let Some(&i) = self.map.get(&key) {
            self.unlink(i);
            self.push_front(i);
            return true;
        }
        let node = Node {
            key,
            prev: NIL,
            next: NIL,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.map.insert(key, i);
        self.push_front(i);
        false
    }

    /// Removes and returns the least recently used key.
    pub fn pop_lru(&mut self) -> Option<u64> {
        let i = self.tail?;
        self.unlink(i);
        self.free.push(i);
        let key = self.nodes[i as usize].key;
        self.map.remove(&key);
        Some(key)
    }

    /// Keys from most to least recently used.
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        let mut at = self.head;
        std::iter::from_fn(move || {
            let i = at?;
            let node = &self.nodes[i as usize];
            at = (node.next != NIL).then_some(node.next);
            Some(node.key)
        })
    }

    /// Removes every key.
    pub fn clear(&mut self) {
        *self = Lru {
            map: std::mem::take(&mut self.map),
            ..Lru::default()
        };
        self.map.clear();
    }

    fn unlink(&mut self, i: u32) {
        let Node { prev, next, .. } = self.nodes[i as usize];
        match prev {
            NIL => self.head = (next != NIL).then_some(next),
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NIL => self.tail = (prev != NIL).then_some(prev),
            n => self.nodes[n as usize].prev = prev,
        }
    }

    fn push_front(&mut self, i: u32) {
        let old = self.head;
        {
            let node = &mut self.nodes[i as usize];
            node.prev = NIL;
            node.next = old.unwrap_or(NIL);
        }
        match old {
            Some(h) => self.nodes[h as usize].prev = i,
            None => self.tail = Some(i),
        }
        self.head = Some(i);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used_first() {
        let mut lru = Lru::new();
        assert!(!lru.touch(1));
        assert!(!lru.touch(2));
        assert!(!lru.touch(3));
        assert!(lru.touch(1)); // 1 is now most recent
        assert_eq!(lru.iter().collect::<Vec<_>>(), vec![1, 3, 2]);
        assert_eq!(lru.pop_lru(), Some(2));
        assert_eq!(lru.pop_lru(), Some(3));
        assert!(!lru.touch(4)); // reuses a freed node
        assert_eq!(lru.iter().collect::<Vec<_>>(), vec![4, 1]);
        assert_eq!(lru.pop_lru(), Some(1));
        assert_eq!(lru.pop_lru(), Some(4));
        assert_eq!(lru.pop_lru(), None);
        assert!(lru.is_empty());
    }

    #[test]
    fn clear_empties() {
        let mut lru = Lru::new();
        lru.touch(1);
        lru.touch(2);
        lru.clear();
        assert_eq!(lru.len(), 0);
        assert!(!lru.contains(1));
        assert_eq!(lru.pop_lru(), None);
        lru.touch(5);
        assert_eq!(lru.iter().collect::<Vec<_>>(), vec![5]);
    }
}
