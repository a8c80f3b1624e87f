//! Grids and blocks of two and three dimensions: each block runs once with
//! its `blockIdx`, each thread once with its `threadIdx`, and warps are
//! taken from the threads' ranks with x fastest, as on the card (a block of
//! 1 x 32 threads is one warp).

use std::path::Path;

use candle_toolkit_cuda_emulation::{compile, run};

/// Each thread's (gridDim, blockDim, blockIdx, threadIdx, rank, its warp's
/// sum of ranks) in the order the harness writes them.
fn threads(grid: [u32; 3], block: [u32; 3]) -> Vec<[u32; 14]> {
    let exe = compile(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/blocks/harness.cpp"));
    let args = grid.iter().chain(&block).map(u32::to_string);
    String::from_utf8(run(&exe, args))
        .unwrap()
        .lines()
        .map(|line| {
            let v: Vec<u32> = line.split(' ').map(|x| x.parse().unwrap()).collect();
            v.try_into().unwrap()
        })
        .collect()
}

#[test]
fn every_thread_of_every_block_runs_once_with_its_indices_and_its_warp() {
    for (grid, block) in [
        ([2, 3, 2], [4, 8, 2]),
        ([3, 1, 1], [1, 32, 1]),
        ([1, 2, 1], [2, 2, 16]),
    ] {
        let got = threads(grid, block);
        let size = block.iter().product::<u32>();
        assert_eq!(got.len() as u32, grid.iter().product::<u32>() * size);
        for (i, t) in got.iter().enumerate() {
            let (b, rank) = (i as u32 / size, i as u32 % size);
            let want_block = [b % grid[0], b / grid[0] % grid[1], b / (grid[0] * grid[1])];
            let want_thread = [
                rank % block[0],
                rank / block[0] % block[1],
                rank / (block[0] * block[1]),
            ];
            let first = rank / 32 * 32;
            // Every block here is whole warps.
            let want_sum = (first..first + 32).sum::<u32>();
            assert_eq!(
                t,
                &[
                    grid[0],
                    grid[1],
                    grid[2],
                    block[0],
                    block[1],
                    block[2],
                    want_block[0],
                    want_block[1],
                    want_block[2],
                    want_thread[0],
                    want_thread[1],
                    want_thread[2],
                    rank,
                    want_sum
                ],
                "grid {grid:?}, block {block:?}, thread {i}"
            );
        }
    }
}
