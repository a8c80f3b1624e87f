//! Ranks as processes with one GPU each, the collectives on NCCL.
//!
//! NCCL needs every rank to start from the same unique id; MPI carries it
//! from rank 0 to the others (as PyTorch's launchers do through their
//! store), and serves the barrier NCCL does not have. The buffers this
//! engine is given are on the host: each collective copies them to the
//! device, runs there, and copies the result back. NCCL refuses two ranks
//! on one GPU, so N ranks need N GPUs.

use std::ffi::c_char;
use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream};
use candle_core::cuda_backend::cudarc::nccl::{Comm as NcclComm, Id, ReduceOp};
use candle_core::{Device, Error, Result};

use crate::comm::Engine;
use crate::mpi::Mpi;

/// The GPUs of an MPI job, one per rank, over NCCL.
pub struct Nccl {
    /// Calls are made one at a time under this lock.
    comm: Mutex<NcclComm>,
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
    mpi: Mpi,
}

// SAFETY: an NCCL communicator and its stream may be used from any thread
// as long as calls are not concurrent; every call takes the mutex.
unsafe impl Send for Nccl {}
// SAFETY: as for `Send`.
unsafe impl Sync for Nccl {}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

fn failed(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Msg(format!("NCCL {what}: {e:?}"))
}

impl Nccl {
    /// An NCCL communicator over the ranks of `mpi`, this rank computing on
    /// `device` (a CUDA device, a different one on each rank of a machine).
    pub fn init(mpi: Mpi, device: &Device) -> Result<Self> {
        let stream = device.as_cuda_device()?.cuda_stream();
        let (rank, size) = (mpi.rank(), mpi.size());
        // A rank that fails here would leave the others waiting for it in
        // the id's broadcast or in NCCL's set-up: end the job instead.
        let or_abort = |r: Result<()>| {
            if let Err(e) = r {
                eprintln!("error: rank {rank}: {e}");
                mpi.abort(1)
            }
        };
        let mut id = [0u8; 128];
        if rank == 0 {
            or_abort(Id::new().map_err(|e| failed("unique id", e)).map(|made| {
                for (b, c) in id.iter_mut().zip(made.internal()) {
                    *b = *c as u8;
                }
            }));
        }
        mpi.broadcast_bytes(&mut id, 0)?;
        let id = Id::uninit(id.map(|b| b as c_char));
        // NCCL sets up on the thread's current device: this rank's.
        or_abort(
            stream
                .context()
                .bind_to_thread()
                .map_err(|e| failed("binding the device", e)),
        );
        let comm = match NcclComm::from_rank(Arc::clone(&stream), rank, size, id) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("error: rank {rank}: {}", failed("communicator", e));
                mpi.abort(1)
            }
        };
        Ok(Self {
            comm: Mutex::new(comm),
            stream,
            rank,
            size,
            mpi,
        })
    }

    /// Copies `send` to the device, runs `op` into a device buffer of
    /// `recv.len()` elements, and copies that back into `recv`.
    fn on_device(
        &self,
        send: &[f32],
        recv: &mut [f32],
        op: impl FnOnce(&NcclComm, &CudaSlice<f32>, &mut CudaSlice<f32>) -> Result<()>,
    ) -> Result<()> {
        // CUDA refuses empty allocations; an empty collective moves nothing.
        if send.is_empty() && recv.is_empty() {
            return Ok(());
        }
        let comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        let d_send = self
            .stream
            .clone_htod(send)
            .map_err(|e| failed("copy to the device", e))?;
        let mut d_recv = self
            .stream
            .alloc_zeros::<f32>(recv.len())
            .map_err(|e| failed("allocation", e))?;
        op(&comm, &d_send, &mut d_recv)?;
        self.stream
            .memcpy_dtoh(&d_recv, recv)
            .map_err(|e| failed("copy to the host", e))?;
        self.stream
            .synchronize()
            .map_err(|e| failed("synchronize", e))
    }
}

impl Engine for Nccl {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_reduce_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        self.on_device(send, recv, |c, s, r| {
            c.all_reduce(s, r, &ReduceOp::Sum)
                .map(drop)
                .map_err(|e| failed("all-reduce", e))
        })
    }
    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        self.on_device(send, recv, |c, s, r| {
            c.reduce_scatter(s, r, &ReduceOp::Sum)
                .map(drop)
                .map_err(|e| failed("reduce-scatter", e))
        })
    }
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        self.on_device(send, recv, |c, s, r| {
            c.all_gather(s, r)
                .map(drop)
                .map_err(|e| failed("all-gather", e))
        })
    }
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        let send = buf.to_vec();
        self.on_device(&send, buf, |c, s, r| {
            c.broadcast(Some(s), r, root as i32)
                .map(drop)
                .map_err(|e| failed("broadcast", e))
        })
    }
    fn barrier(&self) -> Result<()> {
        self.mpi.barrier()
    }
    fn abort(&self, code: i32) -> ! {
        self.mpi.abort(code)
    }
    fn describe(&self) -> String {
        format!("NCCL, {} ranks (one GPU each)", self.size)
    }
}
