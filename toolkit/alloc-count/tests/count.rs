//! The counts of plain, zeroed and grown blocks. One test: the counts are
//! process-wide.

use candle_toolkit_alloc_count::{live, measure, Counting};

#[global_allocator]
static ALLOC: Counting = Counting;

#[test]
fn plain_zeroed_and_grown_blocks_are_counted_to_the_byte() {
    // A plain block.
    let (v, usage) = measure(|| Vec::<u8>::with_capacity(3000));
    assert_eq!(
        (usage.peak, usage.held, usage.allocated),
        (3000, 3000, 3000)
    );
    drop(v);

    // A zeroed block (`vec![0; n]` asks for one): counted as any other,
    // and zero (from the system's calloc, which may hand over fresh pages).
    let (v, usage) = measure(|| vec![0u32; 1 << 20]);
    assert_eq!((usage.peak, usage.held), (4 << 20, 4 << 20));
    assert_eq!(usage.allocated, 4 << 20);
    assert!(v.iter().all(|&x| x == 0));
    drop(v);

    // A block that grows: the system's realloc. Whether it grew in place
    // (one block throughout) or moved (both held while the contents are
    // copied), it ends as one block of the new size.
    let mut v: Vec<u8> = Vec::with_capacity(1000);
    v.extend(std::iter::repeat_n(7u8, 1000));
    let before = live();
    let ((), usage) = measure(|| v.reserve_exact(9000));
    assert_eq!(v.capacity(), 10_000);
    assert_eq!(usage.held, 9000);
    assert!(
        usage.peak == 9000 || usage.peak == 10_000,
        "peak {} above the start: in place 9000, moved 10000",
        usage.peak
    );
    assert!(v.iter().all(|&x| x == 7));
    // And shrinks.
    let ((), usage) = measure(|| v.shrink_to(2000));
    assert_eq!(live() - before, 1000);
    assert_eq!(usage.held, -8000);
    assert!(usage.peak == 0 || usage.peak == 2000, "{}", usage.peak);
    drop(v);
    assert_eq!(live(), before - 1000);
}
