//! The NCCL engine with one rank on a GPU: the collectives, and a ZeRO
//! stage 3 layer's forward and backward on the device against a resident
//! layer. Run it on a GPU machine (`mpirun -n 1` is not needed: MPI starts
//! a single rank by itself).

use std::sync::Arc;

use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_distributed::{Comm, ShardedLinear};

fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) if std::env::var_os("WORKBOOK_REQUIRE_GPU").is_some() => {
            panic!("WORKBOOK_REQUIRE_GPU is set, but no CUDA device answers: {e}")
        }
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            None
        }
    }
}

#[test]
fn one_rank_on_a_gpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let comm = Arc::new(Comm::nccl(&dev)?);
    assert_eq!((comm.rank(), comm.size()), (0, 1));
    let mut buf = vec![1f32, 2.0, 3.0];
    comm.all_reduce_sum(&mut buf)?;
    assert_eq!(buf, [1.0, 2.0, 3.0]);
    let mut out = vec![0f32; 3];
    comm.reduce_scatter_sum(&[4.0, 5.0, 6.0], &mut out)?;
    assert_eq!(out, [4.0, 5.0, 6.0]);
    comm.all_gather(&[7.0, 8.0, 9.0], &mut out)?;
    assert_eq!(out, [7.0, 8.0, 9.0]);
    comm.broadcast(&mut out, 0)?;
    assert_eq!(out, [7.0, 8.0, 9.0]);
    assert_eq!(comm.traffic().total().calls, 4);

    let w = Tensor::randn(0f32, 1.0, (6, 4), &dev)?;
    let b = Tensor::randn(0f32, 1.0, 6, &dev)?;
    let layer = ShardedLinear::new(Arc::clone(&comm), &w, Some(&b), &dev)?;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (3, 4), &dev)?)?;
    let y = layer.forward(&x)?;
    let want = x.as_tensor().matmul(&w.t()?)?.broadcast_add(&b)?;
    let diff = (y.to_dtype(DType::F64)? - want.to_dtype(DType::F64)?)?
        .abs()?
        .max_all()?
        .to_scalar::<f64>()?;
    assert!(diff < 1e-5, "output differs by {diff}");
    let grads = y.sum_all()?.backward()?;
    let gx = grads.get(&x).expect("the input's gradient");
    let want_gx = Tensor::ones((3, 6), DType::F32, &dev)?.matmul(&w)?;
    let diff = (gx - want_gx)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(diff < 1e-5, "input gradient differs by {diff}");
    let blocks = layer.take_grads();
    let gw = blocks
        .get(&layer.vars()[0])
        .expect("the weight's gradient block");
    assert_eq!(gw.elem_count(), 24);
    Ok(())
}
