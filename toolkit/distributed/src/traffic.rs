//! What the collectives moved, per rank.

/// A collective, as counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Collective {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast { root: usize },
}

/// One kind of collective's calls on this rank.
///
/// `payload` is the size of the whole vector the collective is about: the
/// buffer reduced, the input scattered, the output gathered, the buffer
/// broadcast. `sent` and `received` are what this rank puts on and takes
/// off the wire under the bandwidth-optimal ring algorithms (as NCCL's, and
/// MPI libraries' for large buffers): with `N` ranks and payload `n`, a
/// reduce-scatter or an all-gather moves `n (N - 1) / N` each way, an
/// all-reduce (a reduce-scatter then an all-gather) twice that, a pipelined
/// broadcast `n` into every rank but the root and out of every rank but the
/// last. The libraries choose other algorithms for small buffers; these are
/// the figures that ZeRO's analysis uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpTraffic {
    /// Calls made.
    pub calls: u64,
    /// Bytes of the vectors the calls were about.
    pub payload: u64,
    /// Bytes this rank sent.
    pub sent: u64,
    /// Bytes this rank received.
    pub received: u64,
}

impl OpTraffic {
    fn add(&mut self, o: &OpTraffic) {
        self.calls += o.calls;
        self.payload += o.payload;
        self.sent += o.sent;
        self.received += o.received;
    }

    fn minus(&self, o: &OpTraffic) -> OpTraffic {
        OpTraffic {
            calls: self.calls.saturating_sub(o.calls),
            payload: self.payload.saturating_sub(o.payload),
            sent: self.sent.saturating_sub(o.sent),
            received: self.received.saturating_sub(o.received),
        }
    }
}

/// Every collective's calls on this rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// All-reduces.
    pub all_reduce: OpTraffic,
    /// Reduce-scatters.
    pub reduce_scatter: OpTraffic,
    /// All-gathers.
    pub all_gather: OpTraffic,
    /// Broadcasts.
    pub broadcast: OpTraffic,
}

impl Traffic {
    pub(crate) fn count(&mut self, op: Collective, payload: u64, rank: usize, ranks: usize) {
        let n = ranks as u64;
        let ring = payload * (n - 1) / n;
        let (slot, sent, received) = match op {
            Collective::AllReduce => (&mut self.all_reduce, 2 * ring, 2 * ring),
            Collective::ReduceScatter => (&mut self.reduce_scatter, ring, ring),
            Collective::AllGather => (&mut self.all_gather, ring, ring),
            Collective::Broadcast { root } => {
                // The chain runs root, root + 1, ... around the ring.
                let position = (rank + ranks - root) % ranks;
                let sent = if position + 1 < ranks { payload } else { 0 };
                let received = if position > 0 { payload } else { 0 };
                (&mut self.broadcast, sent, received)
            }
        };
        slot.add(&OpTraffic {
            calls: 1,
            payload,
            sent,
            received,
        });
    }

    /// All collectives together.
    pub fn total(&self) -> OpTraffic {
        let mut t = OpTraffic::default();
        for o in [
            &self.all_reduce,
            &self.reduce_scatter,
            &self.all_gather,
            &self.broadcast,
        ] {
            t.add(o);
        }
        t
    }

    /// What was moved since `earlier` (a reading of the same communicator).
    pub fn since(&self, earlier: &Traffic) -> Traffic {
        Traffic {
            all_reduce: self.all_reduce.minus(&earlier.all_reduce),
            reduce_scatter: self.reduce_scatter.minus(&earlier.reduce_scatter),
            all_gather: self.all_gather.minus(&earlier.all_gather),
            broadcast: self.broadcast.minus(&earlier.broadcast),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_volumes() {
        let mut t = Traffic::default();
        t.count(Collective::AllReduce, 4000, 0, 4);
        t.count(Collective::ReduceScatter, 4000, 1, 4);
        t.count(Collective::AllGather, 4000, 2, 4);
        assert_eq!((t.all_reduce.sent, t.all_reduce.received), (6000, 6000));
        assert_eq!(t.reduce_scatter.sent, 3000);
        assert_eq!(t.all_gather.received, 3000);
        assert_eq!(t.total().calls, 3);
        assert_eq!(t.total().sent, 12000);
        let before = t;
        t.count(Collective::AllGather, 800, 2, 4);
        assert_eq!(t.since(&before).all_gather.sent, 600);
        assert_eq!(t.since(&before).all_reduce, OpTraffic::default());
    }

    #[test]
    fn one_rank_moves_nothing() {
        let mut t = Traffic::default();
        t.count(Collective::AllReduce, 4000, 0, 1);
        t.count(Collective::Broadcast { root: 0 }, 4000, 0, 1);
        assert_eq!(t.total().sent + t.total().received, 0);
        assert_eq!(t.total().payload, 8000);
    }

    #[test]
    fn broadcast_chain() {
        let counts: Vec<(u64, u64)> = (0..3)
            .map(|rank| {
                let mut t = Traffic::default();
                t.count(Collective::Broadcast { root: 1 }, 100, rank, 3);
                (t.broadcast.sent, t.broadcast.received)
            })
            .collect();
        // Root 1 sends, 2 passes on, 0 (the last in the chain) only receives.
        assert_eq!(counts, [(0, 100), (100, 0), (100, 100)]);
    }
}
