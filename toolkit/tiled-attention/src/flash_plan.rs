//! Which of `kernels/flash_*.cu`'s kernels a call launches, and with what
//! grid: plain arithmetic on the call's sizes, apart from the launching
//! itself so that the kernels' CPU emulation in the tests runs the very
//! launches a GPU gets.

use candle_core::DType;

use crate::shapes::Dims;

/// One kernel launch: the kernel's name, its grid `(x, y)` and its threads
/// per block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Launch {
    pub name: String,
    pub grid: (u32, u32),
    pub block: u32,
}

/// The four launches of a call, in the module of its padded head
/// dimension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    /// 32, 64 or 128: the head dimensions, padded.
    pub padded: usize,
    pub forward: Launch,
    pub delta: Launch,
    pub backward_kv: Launch,
    pub backward_q: Launch,
}

/// The widest head dimension the kernels take.
pub(crate) const MAX_HEAD_DIM: usize = 128;

/// Threads per block of the forward's and the backward's kernels, as
/// `Tiles<D>::THREADS` in `kernels/flash.cuh`.
const THREADS: usize = 128;

/// Rows a block owns at padded dimension `padded`: each row has a lane per
/// 16 of its columns (`Tiles<D>::ROWS`).
fn rows_per_block(padded: usize) -> usize {
    THREADS / (padded / 16)
}

/// Threads per block of the row-wise `delta` kernel, a warp per row
/// (`DELTA_THREADS`).
const DELTA_BLOCK: usize = 256;
const DELTA_ROWS: usize = DELTA_BLOCK / 32;

/// The launches for a call of these sizes and dtype, or `None` where the
/// kernels do not apply: a dtype other than f32, f16 and bf16, a head
/// dimension of 0 or over [`MAX_HEAD_DIM`], or sizes past the kernels'
/// 32-bit arguments and 65,535 rows of grid.
pub(crate) fn plan(dims: &Dims, dtype: DType) -> Option<Plan> {
    // The kernels are named by candle's name for the dtype.
    let suffix = match dtype {
        DType::F32 | DType::F16 | DType::BF16 => dtype.as_str(),
        _ => return None,
    };
    let widest = dims.d.max(dims.dv);
    if dims.d == 0 || dims.dv == 0 || widest > MAX_HEAD_DIM {
        return None;
    }
    let padded = [32, 64, 128].into_iter().find(|&p| p >= widest)?;
    // The kernels add up to a block's rows or a tile's to a row index in
    // 32 bits.
    let fits_i32 = |n: usize| n <= i32::MAX as usize - 128;
    let fits_grid_y = |n: usize| n > 0 && n <= 65_535;
    if ![dims.nq, dims.nk, dims.q_heads].into_iter().all(fits_i32)
        || !fits_grid_y(dims.rows())
        || !fits_grid_y(dims.batch * dims.kv_heads)
    {
        return None;
    }
    let per_block = rows_per_block(padded);
    let blocks = |n: usize| u32::try_from(n.div_ceil(per_block)).ok();
    let (q_blocks, k_blocks) = (blocks(dims.nq)?, blocks(dims.nk)?);
    let launch = |kernel: &str, grid: (u32, u32), block: usize| Launch {
        name: format!("flash_{kernel}_{padded}_{suffix}"),
        grid,
        block: block as u32,
    };
    let rows = dims.rows() as u32;
    // The delta kernel strides over rows past its grid.
    let delta_blocks = dims
        .rows()
        .checked_mul(dims.nq)?
        .div_ceil(DELTA_ROWS)
        .clamp(1, 65_535) as u32;
    Some(Plan {
        padded,
        forward: launch("forward", (q_blocks, rows), THREADS),
        delta: launch("delta", (delta_blocks, 1), DELTA_BLOCK),
        backward_kv: launch(
            "backward_kv",
            (k_blocks, (dims.batch * dims.kv_heads) as u32),
            THREADS,
        ),
        backward_q: launch("backward_q", (q_blocks, rows), THREADS),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(d: usize, dv: usize) -> Dims {
        Dims {
            batch: 2,
            q_heads: 8,
            kv_heads: 2,
            nq: 100,
            nk: 300,
            d,
            dv,
        }
    }

    #[test]
    fn head_dimensions_pad_to_the_next_kernel() {
        let padded = |d, dv| plan(&dims(d, dv), DType::F32).map(|p| p.padded);
        assert_eq!(padded(1, 1), Some(32));
        assert_eq!(padded(32, 32), Some(32));
        assert_eq!(padded(33, 16), Some(64));
        assert_eq!(padded(64, 80), Some(128));
        assert_eq!(padded(128, 128), Some(128));
        assert_eq!(padded(129, 128), None);
        assert_eq!(padded(0, 64), None);
        assert_eq!(padded(64, 0), None);
    }

    #[test]
    fn grids_cover_every_row_and_key() {
        let p = plan(&dims(64, 64), DType::BF16).unwrap();
        assert_eq!(p.forward.name, "flash_forward_64_bf16");
        // 100 queries in blocks of 32 rows of 4 lanes; 16 (batch, q_head)
        // rows.
        assert_eq!((p.forward.grid, p.forward.block), ((4, 16), 128));
        assert_eq!(p.backward_q.grid, (4, 16));
        // 300 keys in blocks of 32; 4 (batch, kv_head) rows.
        assert_eq!(p.backward_kv.grid, (10, 4));
        // 1,600 rows, 8 to a block of 256 threads.
        assert_eq!((p.delta.grid, p.delta.block), ((200, 1), 256));
        // 16 rows of 8 lanes, and 64 of 2.
        let wide = plan(&dims(128, 128), DType::F16).unwrap();
        assert_eq!((wide.forward.grid, wide.forward.block), ((7, 16), 128));
        let narrow = plan(&dims(32, 32), DType::F32).unwrap();
        assert_eq!(
            (narrow.backward_kv.grid, narrow.backward_kv.block),
            ((5, 4), 128)
        );
        assert_eq!(wide.backward_kv.name, "flash_backward_kv_128_f16");
    }

    #[test]
    fn other_dtypes_and_oversized_grids_are_left_to_the_composed_path() {
        assert_eq!(plan(&dims(64, 64), DType::F64), None);
        let many = Dims {
            batch: 65_536,
            ..dims(64, 64)
        };
        assert_eq!(plan(&many, DType::F32), None);
        // A row index plus a block's rows stays within 32 bits.
        let long = |n: usize| Dims {
            nq: n,
            ..dims(64, 64)
        };
        assert_eq!(plan(&long(i32::MAX as usize - 127), DType::F32), None);
        let p = plan(&long(i32::MAX as usize - 128), DType::F32).unwrap();
        // 16 rows of 2^31 queries: past 65,535 blocks of 8, so capped.
        assert_eq!(p.delta.grid, (65_535, 1));
    }
}
