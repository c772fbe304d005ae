//! `Communicator::split`: exchange everyone's (color, key), then form the groups.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::{BufMut, Bytes, BytesMut};

use super::{Communicator, Group};
use crate::error::Error;

/// One rank's entry: `None` color is MPI_UNDEFINED.
type Entry = (Option<u32>, i32);

const ENTRY_BYTES: usize = 12;

fn encode(entries: &[Entry]) -> Bytes {
    let mut b = BytesMut::with_capacity(entries.len() * ENTRY_BYTES);
    for &(color, key) in entries {
        b.put_i64_le(color.map_or(-1, i64::from));
        b.put_i32_le(key);
    }
    b.freeze()
}

fn decode(data: &[u8], expected: usize, peer: usize) -> Result<Vec<Entry>, Error> {
    if data.len() != expected * ENTRY_BYTES {
        return Err(Error::Protocol {
            peer,
            detail: format!(
                "split table of {} bytes, expected {}",
                data.len(),
                expected * ENTRY_BYTES
            ),
        });
    }
    Ok(data
        .chunks_exact(ENTRY_BYTES)
        .map(|c| {
            let color = i64::from_le_bytes(c[..8].try_into().unwrap_or_default());
            let key = i32::from_le_bytes(c[8..].try_into().unwrap_or_default());
            (u32::try_from(color).ok(), key)
        })
        .collect())
}

pub(super) async fn split(
    comm: &Communicator,
    color: Option<u32>,
    key: i32,
) -> Result<Option<Communicator>, Error> {
    let child = comm.inner.children.fetch_add(1, Ordering::Relaxed);
    let tag = comm.next_collective();
    let size = comm.size();
    let me = comm.rank();
    // Gather every (color, key) at rank 0, which sends the whole table back to everyone.
    let table = if me == 0 {
        let recvs: Vec<_> = (1..size).map(|r| comm.collective_recv(r, tag)).collect();
        let mut table = vec![(color, key)];
        for (i, op) in recvs.into_iter().enumerate() {
            let msg = op.await?;
            table.extend(decode(msg.data(), 1, i + 1)?);
        }
        let bytes = encode(&table);
        let sends: Vec<_> = (1..size)
            .map(|r| comm.collective_send(r, tag, bytes.clone()))
            .collect();
        for s in sends {
            s.await?;
        }
        table
    } else {
        let back = comm.collective_recv(0, tag);
        comm.collective_send(0, tag, encode(&[(color, key)]))
            .await?;
        decode(back.await?.data(), size, 0)?
    };
    let Some(color) = color else {
        return Ok(None);
    };
    let mut members: Vec<(i32, usize)> = table
        .iter()
        .enumerate()
        .filter(|(_, (c, _))| *c == Some(color))
        .map(|(rank, &(_, k))| (k, rank))
        .collect();
    members.sort_unstable();
    let new_rank = members
        .iter()
        .position(|&(_, r)| r == me)
        .ok_or_else(|| Error::Protocol {
            peer: 0,
            detail: "split table does not contain this rank".into(),
        })?;
    let world: Vec<u32> = members
        .iter()
        .map(|&(_, r)| comm.inner.group.world_of(r).unwrap_or(r as u32))
        .collect();
    let context = comm.inner.context.derive(child, u64::from(color));
    Ok(Some(Communicator::from_parts(
        Arc::clone(&comm.inner.driver),
        Arc::clone(&comm.inner.life),
        context,
        new_rank,
        Group::members(world),
        comm.inner.multicast.clone(),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_round_trips_and_rejects_bad_lengths() {
        let t = vec![(Some(3), -1), (None, 7), (Some(0), i32::MAX)];
        assert_eq!(decode(&encode(&t), 3, 0).unwrap(), t);
        assert!(decode(&encode(&t)[..20], 3, 0).is_err());
    }
}
