//! [`BinomialTree`]: the binomial tree over a communicator's ranks that broadcast, gather,
//! scatter and reduce share.

use std::ops::Range;

use crate::ctx::Ctx;

/// A rank's place in the binomial tree rooted at `root`, over ranks renumbered relative to the
/// root (relative rank = (rank − root) mod n). The parent of relative rank r is r with its lowest
/// set bit cleared; its children are r + 2^k for every 2^k below that bit (below n for the
/// root), and the subtree of r is the contiguous relative range r .. r + lowbit(r).
#[derive(Clone, Debug)]
pub(crate) struct BinomialTree {
    pub n: usize,
    pub root: usize,
    /// This rank's relative rank.
    pub relative: usize,
}

/// `(a + b) mod n` for `a, b < n` (`b <= n`): a compare instead of a hardware division,
/// which costs tens of cycles and sits on every small collective's path.
pub(crate) fn modular_add(a: usize, b: usize, n: usize) -> usize {
    let sum = a + b;
    if sum >= n { sum - n } else { sum }
}

/// A child in a [`BinomialTree`]: its rank and the relative ranks of its subtree.
#[derive(Clone, Debug)]
pub(crate) struct Child {
    pub rank: usize,
    pub relative: Range<usize>,
}

impl BinomialTree {
    pub(crate) fn new(cx: &Ctx, root: usize) -> BinomialTree {
        BinomialTree::of(cx.size, cx.rank, root)
    }

    /// Rank `rank`'s place in the tree over `n` ranks rooted at `root`.
    pub(crate) fn of(n: usize, rank: usize, root: usize) -> BinomialTree {
        BinomialTree {
            n,
            root,
            relative: modular_add(rank, n - root, n),
        }
    }

    /// The rank of relative rank `relative`.
    pub(crate) fn absolute(&self, relative: usize) -> usize {
        modular_add(relative, self.root, self.n)
    }

    /// The lowest set bit of the relative rank (past the top of the tree for the root).
    fn low_bit(&self) -> usize {
        if self.relative == 0 {
            self.n.next_power_of_two()
        } else {
            self.relative & self.relative.wrapping_neg()
        }
    }

    /// The parent's rank; `None` at the root.
    pub(crate) fn parent(&self) -> Option<usize> {
        (self.relative != 0).then(|| self.absolute(self.relative - self.low_bit()))
    }

    /// The relative ranks of this rank's subtree (itself first).
    pub(crate) fn subtree(&self) -> Range<usize> {
        self.relative..self.n.min(self.relative + self.low_bit())
    }

    /// The children in increasing relative rank (so their subtrees follow each other); an
    /// iterator, so that walking them allocates nothing.
    pub(crate) fn children(&self) -> Children {
        Children {
            tree: self.clone(),
            mask: 1,
        }
    }
}

/// The children of a rank in a [`BinomialTree`] (see [`BinomialTree::children`]).
#[derive(Clone, Debug)]
pub(crate) struct Children {
    tree: BinomialTree,
    /// The next child is `relative + mask`.
    mask: usize,
}

impl Iterator for Children {
    type Item = Child;

    fn next(&mut self) -> Option<Child> {
        let t = &self.tree;
        if self.mask >= t.low_bit() || t.relative + self.mask >= t.n {
            return None;
        }
        let first = t.relative + self.mask;
        let child = Child {
            rank: t.absolute(first),
            relative: first..t.n.min(first + self.mask),
        };
        self.mask <<= 1;
        Some(child)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binomial_subtrees_partition_the_ranks() {
        for n in 1..40 {
            for root in [0, n / 2, n - 1] {
                let trees: Vec<BinomialTree> =
                    (0..n).map(|rank| BinomialTree::of(n, rank, root)).collect();
                for tree in &trees {
                    // The subtree is the node and its children's subtrees, back to back.
                    let mut next = tree.relative + 1;
                    for child in tree.children() {
                        assert_eq!(child.relative.start, next);
                        let child_tree = &trees[child.rank];
                        assert_eq!(child_tree.parent(), Some(tree.absolute(tree.relative)));
                        assert_eq!(child_tree.subtree(), child.relative);
                        next = child.relative.end;
                    }
                    assert_eq!(next, tree.subtree().end, "n={n} root={root}");
                }
                assert_eq!(trees[root].subtree(), 0..n);
            }
        }
    }
}
