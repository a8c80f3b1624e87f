//! Data parallelism and ZeRO sharding for candle 0.11, on a real collective
//! library, with the bytes each rank holds and sends.
//!
//! * [`Comm`]: the ranks of a job and their collectives (all-reduce,
//!   reduce-scatter, all-gather, broadcast, barrier) on `f32` buffers, over
//!   an [`Engine`]: [`Mpi`] (feature `mpi`: ranks as processes under
//!   `mpirun`, on one machine or a cluster), `Nccl` (feature `nccl`: one
//!   GPU per rank, NCCL's collectives, MPI to start them), [`Solo`] (one
//!   process), [`Rehearsal`] (one rank of N in one process, the peers
//!   stand-ins: a rank's memory and traffic measured without a job) or
//!   [`Threads`] (N ranks as threads of one process, the values real: a
//!   job's arithmetic checked without a library). Each
//!   call is counted ([`Traffic`]: payload, and bytes sent and received per
//!   rank under the ring algorithms), and the buffers it allocates are
//!   reported to an observer as
//!   [`Kind::Communication`](candle_observe::Kind::Communication).
//! * [`DataParallel`]: DistributedDataParallel's gradient averaging, in
//!   buckets, after the backward or during a layer-wise one
//!   ([`Bucketing`]).
//! * [`ZeroAdamW`]: ZeRO stages 1 and 2, the optimizer state (and the
//!   gradients) partitioned.
//! * [`ShardedLinear`]: ZeRO stage 3 / FSDP, the parameters partitioned too
//!   and gathered for each use; the same mechanism as
//!   `candle_offload::StreamedLinear`, with the peers as the source; and
//!   [`ShardedParam`] for every other parameter (a norm's scale, an
//!   embedding table), gathered as an operation of candle's autograd.
//!
//! Per rank, with Ψ parameters, `N` ranks and AdamW in f32 (4 bytes per
//! parameter, 4 per gradient, 8 of moments), the model states are
//! `16Ψ` under DDP, `8Ψ + 8Ψ/N` under stage 1, `4Ψ + 12Ψ/N` under stage 2
//! and `16Ψ/N` under stage 3; Rajbhandari et al. (2020) give the mixed
//! precision form (2-byte parameters and gradients, K = 12 bytes of f32
//! master weights and moments): `(4 + K)Ψ`, `4Ψ + KΨ/N`, `2Ψ + (2 + K)Ψ/N`,
//! `(4 + K)Ψ/N`.
#![warn(missing_docs)]

mod agree;
mod comm;
mod ddp;
mod fsdp;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "nccl")]
mod nccl;
mod param;
mod rehearsal;
mod shard;
mod split;
mod threads;
mod traffic;
mod zero;

/// The activation `ShardedLinear::forward_act` takes: re-exported, so that
/// a caller needs no `candle-lean-nn` of its own for it.
pub use candle_lean_nn::Activation;
/// The measurement hook that calls here accept, and the one that does
/// nothing (`&NoObserver`): re-exported, so that a caller needs no
/// `candle-observe` of its own for them.
pub use candle_observe::{NoObserver, Observer};
pub use comm::{Comm, Engine, Solo};
pub use ddp::{Bucketing, DataParallel, DEFAULT_BUCKET_BYTES};
pub use fsdp::ShardedLinear;
#[cfg(feature = "mpi")]
pub use mpi::Mpi;
#[cfg(feature = "nccl")]
pub use nccl::Nccl;
pub use param::ShardedParam;
pub use rehearsal::Rehearsal;
pub use shard::Shard;
pub use split::Split;
pub use threads::Threads;
pub use traffic::{OpTraffic, Traffic};
pub use zero::{ZeroAdamW, ZeroConfig};

impl Comm {
    /// The world of the MPI job this process is a rank of (one rank when
    /// started without `mpirun`). MPI is initialized once per process.
    #[cfg(feature = "mpi")]
    pub fn mpi() -> candle_core::Result<Self> {
        Ok(Self::new(Mpi::init()?))
    }

    /// The GPUs of the MPI job this process is a rank of, over NCCL, this
    /// rank computing on `device`.
    #[cfg(feature = "nccl")]
    pub fn nccl(device: &candle_core::Device) -> candle_core::Result<Self> {
        Ok(Self::new(Nccl::init(Mpi::init()?, device)?))
    }
}
