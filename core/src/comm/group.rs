//! Which world ranks a communicator holds, and the translation both ways.

use std::sync::Arc;

use rustc_hash::FxHashMap;

/// The members of a communicator.
#[derive(Clone, Debug)]
pub(crate) enum Group {
    /// Every rank of the job, numbered as in the world.
    World { size: usize },
    /// A subset, in communicator order.
    Members(Arc<Members>),
}

#[derive(Debug)]
pub(crate) struct Members {
    world: Vec<u32>,
    local: FxHashMap<u32, usize>,
}

impl Group {
    /// A group of the given world ranks, in communicator order.
    pub(crate) fn members(world: Vec<u32>) -> Group {
        let local = world.iter().enumerate().map(|(i, &w)| (w, i)).collect();
        Group::Members(Arc::new(Members { world, local }))
    }

    pub(crate) fn size(&self) -> usize {
        match self {
            Group::World { size } => *size,
            Group::Members(m) => m.world.len(),
        }
    }

    /// The world rank of communicator rank `rank`.
    pub(crate) fn world_of(&self, rank: usize) -> Option<u32> {
        match self {
            Group::World { size } => (rank < *size).then_some(rank as u32),
            Group::Members(m) => m.world.get(rank).copied(),
        }
    }

    /// The communicator rank of world rank `world`.
    pub(crate) fn local_of(&self, world: u32) -> Option<usize> {
        match self {
            Group::World { size } => ((world as usize) < *size).then_some(world as usize),
            Group::Members(m) => m.local.get(&world).copied(),
        }
    }
}
