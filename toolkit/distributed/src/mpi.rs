//! Ranks as MPI processes.

use std::sync::Mutex;

use candle_core::{bail, Result};
use mpi::collective::SystemOperation;
use mpi::environment::{Threading, Universe};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::{CommunicatorCollectives, Root};

use crate::comm::Engine;

/// The world of an MPI job (`mpirun -n N program`): MPI is initialized when
/// it is made and finalized when it is dropped, once per process.
pub struct Mpi {
    /// The world communicator; MPI calls are made one at a time under this
    /// lock (MPI is initialized for serialized calls from any thread).
    world: Mutex<SimpleCommunicator>,
    rank: usize,
    size: usize,
    // Dropped last: finalizes MPI.
    _universe: Universe,
}

// SAFETY: the communicator is a handle that MPI lets any thread use under
// `MPI_THREAD_SERIALIZED`, which `Mpi::init` requires; every call takes the
// mutex, so no two are concurrent.
unsafe impl Send for Mpi {}
// SAFETY: as for `Send`: shared use goes through the mutex.
unsafe impl Sync for Mpi {}

impl std::fmt::Debug for Mpi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mpi")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

impl Mpi {
    /// Initializes MPI. Fails if it was initialized before in this process,
    /// or if the library cannot serialize calls from several threads.
    pub fn init() -> Result<Self> {
        let Some((universe, threading)) = mpi::initialize_with_threading(Threading::Serialized)
        else {
            bail!("MPI is initialized already in this process: make one Mpi and share it");
        };
        if matches!(threading, Threading::Single | Threading::Funneled) {
            bail!("the MPI library offers {threading:?} threading; serialized calls from any thread are needed");
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        Ok(Self {
            world: Mutex::new(world),
            rank,
            size,
            _universe: universe,
        })
    }

    /// Broadcasts raw bytes from `root` (NCCL's unique id, say).
    pub fn broadcast_bytes(&self, buf: &mut [u8], root: usize) -> Result<()> {
        if root >= self.size {
            bail!(
                "broadcast from rank {root}, but there are {} ranks",
                self.size
            );
        }
        let world = self.world();
        world.process_at_rank(root as i32).broadcast_into(buf);
        Ok(())
    }

    fn world(&self) -> std::sync::MutexGuard<'_, SimpleCommunicator> {
        self.world.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Engine for Mpi {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_reduce_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        self.world()
            .all_reduce_into(send, recv, SystemOperation::sum());
        Ok(())
    }
    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        self.world()
            .reduce_scatter_block_into(send, recv, SystemOperation::sum());
        Ok(())
    }
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        self.world().all_gather_into(send, recv);
        Ok(())
    }
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        let world = self.world();
        world.process_at_rank(root as i32).broadcast_into(buf);
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        self.world().barrier();
        Ok(())
    }
    fn abort(&self, code: i32) -> ! {
        // Without the lock: another thread may hold it, blocked in the very
        // collective this abort is meant to end.
        // SAFETY: MPI is initialized (this value exists) and MPI_Abort may
        // be called from any thread under MPI_THREAD_SERIALIZED's terms
        // when the process is ending.
        unsafe {
            mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, code);
        }
        std::process::exit(code)
    }
    fn describe(&self) -> String {
        let library = mpi::environment::library_version().unwrap_or_default();
        let first = library.lines().next().unwrap_or("MPI").trim().to_string();
        format!("{first}, {} ranks", self.size)
    }
}
