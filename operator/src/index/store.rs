//! A map of namespaced objects by namespace, then name: the index keeps its
//! pools, pods, policies and published states in these.
//!
//! Ordered maps, so everything derived from them (endpoint lists, status
//! lists) comes out in a deterministic order. Not here: any Kubernetes
//! semantics.

use std::collections::BTreeMap;

/// Objects of one kind by namespace, then name. An empty namespace is
/// dropped, so iterating never visits one.
#[derive(Debug)]
pub(super) struct Namespaced<T>(BTreeMap<String, BTreeMap<String, T>>);

impl<T> Default for Namespaced<T> {
    fn default() -> Self {
        Namespaced(BTreeMap::new())
    }
}

impl<T> Namespaced<T> {
    /// The object `namespace/name`.
    pub(super) fn get(&self, namespace: &str, name: &str) -> Option<&T> {
        self.0.get(namespace)?.get(name)
    }

    /// Stores `value` as `namespace/name`, returning what it replaced.
    pub(super) fn insert(&mut self, namespace: &str, name: &str, value: T) -> Option<T> {
        self.0
            .entry(namespace.to_owned())
            .or_default()
            .insert(name.to_owned(), value)
    }

    /// Removes `namespace/name`, returning it.
    pub(super) fn remove(&mut self, namespace: &str, name: &str) -> Option<T> {
        let names = self.0.get_mut(namespace)?;
        let removed = names.remove(name);
        if names.is_empty() {
            self.0.remove(namespace);
        }
        removed
    }

    /// The objects of `namespace`, by name.
    pub(super) fn in_namespace<'a>(
        &'a self,
        namespace: &str,
    ) -> impl Iterator<Item = (&'a str, &'a T)> + 'a {
        self.0
            .get(namespace)
            .into_iter()
            .flat_map(|names| names.iter().map(|(n, v)| (n.as_str(), v)))
    }

    /// Every object with its namespace and name, in order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (&str, &str, &T)> {
        self.0
            .iter()
            .flat_map(|(ns, names)| names.iter().map(move |(n, v)| (ns.as_str(), n.as_str(), v)))
    }

    /// Every `(namespace, name)`, in order.
    pub(super) fn keys(&self) -> Vec<(String, String)> {
        self.iter()
            .map(|(ns, n, _)| (ns.to_owned(), n.to_owned()))
            .collect()
    }

    /// Keeps only the objects for which `keep` is true.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(&str, &str, &T) -> bool) {
        self.0.retain(|ns, names| {
            names.retain(|n, v| keep(ns, n, v));
            !names.is_empty()
        });
    }
}

impl<T> FromIterator<(String, String, T)> for Namespaced<T> {
    fn from_iter<I: IntoIterator<Item = (String, String, T)>>(iter: I) -> Self {
        let mut map = Namespaced::default();
        for (ns, name, value) in iter {
            map.insert(&ns, &name, value);
        }
        map
    }
}
