//! An allocation interposer that counts a whole process as the workbook's
//! own allocator does: loaded with `LD_PRELOAD`, it takes the C allocator's
//! place (`malloc`, `free` and the rest, as glibc documents for replacing
//! it), hands each request to glibc's allocator with a 16-byte header in
//! front, and keeps `workbook_sdk::meter`'s counters by category through
//! [`workbook_sdk::meter::raw`]; it exports them under the names of
//! [`workbook_sdk::meter::raw::symbols`], where the SDK's `KernelMeter` and
//! tag setters find them.
//!
//! Its use is a Jupyter kernel: evcxr compiles each notebook cell into a
//! library of its own, each with its own copy of every crate's statics, and
//! the kernel's allocator is the C one. With this library preloaded, every
//! allocation of the process goes through one set of counters whatever
//! library made it, so a 1000 x 1000 f32 tensor made in one cell moves the
//! count by exactly its 4,000,000 bytes of data, and its free in a later
//! cell is charged back to the category that allocated it.
//!
//! Only a process that is asked to is counted: evcxr's runtime (the child
//! process that runs the cells, `EVCXR_IS_RUNTIME` in its environment) or
//! one with `WORKBOOK_HEAP_COUNT=1`. Any other process that inherits
//! `LD_PRELOAD` (the kernel itself, the compilers it starts) gets glibc's
//! allocator unchanged. The choice is made once, at the first allocation,
//! from `/proc/self/environ`, before the C library has set its environment
//! up, and never changes, so no block ever crosses the two ways.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU8, Ordering};

use workbook_sdk::meter::raw;

extern "C" {
    fn __libc_malloc(size: usize) -> *mut c_void;
    fn __libc_calloc(n: usize, size: usize) -> *mut c_void;
    fn __libc_realloc(ptr: *mut c_void, size: usize) -> *mut c_void;
    fn __libc_free(ptr: *mut c_void);
    fn __libc_memalign(align: usize, size: usize) -> *mut c_void;
}

/// The header in front of a counted block: 16 bytes, so that a block from
/// glibc (16-aligned) stays 16-aligned after it.
#[repr(C)]
struct Header {
    /// Bytes the caller asked for.
    size: u64,
    /// From the start of glibc's block to the caller's.
    offset: u32,
    /// The category and residency it was counted under.
    tag: u8,
    _pad: [u8; 3],
}

const HEADER: usize = std::mem::size_of::<Header>();
const _: () = assert!(HEADER == 16);

const UNDECIDED: u8 = 0;
const PASS: u8 = 1;
const COUNT: u8 = 2;
static MODE: AtomicU8 = AtomicU8::new(UNDECIDED);

/// Whether this process counts: decided once, from its environment as the
/// kernel gave it (no allocation, no C library state).
fn counting() -> bool {
    match MODE.load(Ordering::Relaxed) {
        COUNT => true,
        PASS => false,
        _ => {
            let mode = if asked_to_count() { COUNT } else { PASS };
            // Two threads deciding at once read the same file.
            MODE.store(mode, Ordering::Relaxed);
            mode == COUNT
        }
    }
}

/// Whether `/proc/self/environ` holds `EVCXR_IS_RUNTIME=` or
/// `WORKBOOK_HEAP_COUNT=1`, read with system calls into a stack buffer.
fn asked_to_count() -> bool {
    const WANTED: [&[u8]; 2] = [b"EVCXR_IS_RUNTIME=", b"WORKBOOK_HEAP_COUNT=1\0"];
    // SAFETY: open, read and close on a buffer of ours.
    unsafe {
        let fd = libc::open(
            c"/proc/self/environ".as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        );
        if fd < 0 {
            return false;
        }
        // Entries are NUL-separated; keep the start of the current one
        // across reads (no wanted entry is longer than `entry`).
        let mut entry = [0u8; 32];
        let mut len = 0usize;
        let mut buf = [0u8; 4096];
        let mut found = false;
        'read: loop {
            let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
            if n <= 0 {
                break;
            }
            for &b in &buf[..n as usize] {
                if len < entry.len() {
                    entry[len] = b;
                }
                len += 1;
                let seen = &entry[..len.min(entry.len())];
                if WANTED.contains(&seen) {
                    found = true;
                    break 'read;
                }
                if b == 0 {
                    len = 0;
                }
            }
        }
        libc::close(fd);
        found
    }
}

/// Hands out `size` bytes aligned to `align` (a power of two, at most the
/// header's alignment when 0) and counts them.
unsafe fn counted(size: usize, align: usize, zeroed: bool) -> *mut c_void {
    let offset = align.max(HEADER);
    let Some(outer) = size.checked_add(offset + if align > HEADER { align } else { 0 }) else {
        return std::ptr::null_mut();
    };
    let base = if zeroed {
        unsafe { __libc_calloc(1, outer) }
    } else {
        unsafe { __libc_malloc(outer) }
    } as *mut u8;
    if base.is_null() {
        return base.cast();
    }
    // The caller's block: right after the header, or at the first multiple
    // of `align` past it.
    let user = if align > HEADER {
        let after = base as usize + HEADER;
        (after + align - 1) & !(align - 1)
    } else {
        base as usize + HEADER
    } as *mut u8;
    let tag = raw::tag();
    // SAFETY: the header lies inside glibc's block, just before `user`.
    unsafe {
        user.cast::<Header>().sub(1).write(Header {
            size: size as u64,
            offset: (user as usize - base as usize) as u32,
            tag,
            _pad: [0; 3],
        });
    }
    raw::allocated(tag, size as u64);
    user.cast()
}

/// The header of a counted block.
unsafe fn header(ptr: *mut c_void) -> *mut Header {
    unsafe { ptr.cast::<Header>().sub(1) }
}

unsafe fn uncount(ptr: *mut c_void) -> *mut c_void {
    let h = unsafe { &*header(ptr) };
    raw::freed(h.tag, h.size);
    unsafe { ptr.cast::<u8>().sub(h.offset as usize).cast() }
}

/// # Safety
/// The C allocator's contract.
#[no_mangle]
pub unsafe extern "C" fn malloc(size: usize) -> *mut c_void {
    if !counting() {
        return unsafe { __libc_malloc(size) };
    }
    unsafe { counted(size, 0, false) }
}

/// # Safety
/// The C allocator's contract.
#[no_mangle]
pub unsafe extern "C" fn calloc(n: usize, size: usize) -> *mut c_void {
    if !counting() {
        return unsafe { __libc_calloc(n, size) };
    }
    match n.checked_mul(size) {
        Some(total) => unsafe { counted(total, 0, true) },
        None => std::ptr::null_mut(),
    }
}

/// # Safety
/// The C allocator's contract.
#[no_mangle]
pub unsafe extern "C" fn free(ptr: *mut c_void) {
    if ptr.is_null() {
        return;
    }
    if !counting() {
        return unsafe { __libc_free(ptr) };
    }
    unsafe { __libc_free(uncount(ptr)) }
}

/// # Safety
/// The C allocator's contract.
#[no_mangle]
pub unsafe extern "C" fn realloc(ptr: *mut c_void, size: usize) -> *mut c_void {
    if !counting() {
        return unsafe { __libc_realloc(ptr, size) };
    }
    if ptr.is_null() {
        return unsafe { counted(size, 0, false) };
    }
    if size == 0 {
        unsafe { free(ptr) };
        return std::ptr::null_mut();
    }
    let (old, offset, tag) = {
        let h = unsafe { &*header(ptr) };
        (h.size as usize, h.offset as usize, h.tag)
    };
    if offset != HEADER {
        // An over-aligned block: a new one, the bytes copied.
        let new = unsafe { counted(size, 0, false) };
        if !new.is_null() {
            unsafe {
                std::ptr::copy_nonoverlapping(ptr.cast::<u8>(), new.cast(), old.min(size));
                free(ptr);
            }
        }
        return new;
    }
    let Some(outer) = size.checked_add(HEADER) else {
        return std::ptr::null_mut();
    };
    let base = unsafe { __libc_realloc(ptr.cast::<u8>().sub(HEADER).cast(), outer) } as *mut u8;
    if base.is_null() {
        // The old block stands, counted as it was.
        return base.cast();
    }
    // A block that grows stays what it was: its tag is kept.
    raw::freed(tag, old as u64);
    raw::allocated(tag, size as u64);
    unsafe {
        let user = base.add(HEADER);
        (*header(user.cast())).size = size as u64;
        user.cast()
    }
}

/// # Safety
/// The C allocator's contract.
#[no_mangle]
pub unsafe extern "C" fn memalign(align: usize, size: usize) -> *mut c_void {
    if !counting() {
        return unsafe { __libc_memalign(align, size) };
    }
    if !align.is_power_of_two() {
        return std::ptr::null_mut();
    }
    unsafe { counted(size, align, false) }
}

/// # Safety
/// The C allocator's contract.
#[no_mangle]
pub unsafe extern "C" fn aligned_alloc(align: usize, size: usize) -> *mut c_void {
    unsafe { memalign(align, size) }
}

/// # Safety
/// The C allocator's contract.
#[no_mangle]
pub unsafe extern "C" fn posix_memalign(
    out: *mut *mut c_void,
    align: usize,
    size: usize,
) -> libc::c_int {
    if !align.is_power_of_two() || !align.is_multiple_of(std::mem::size_of::<usize>()) {
        return libc::EINVAL;
    }
    let p = unsafe { memalign(align, size) };
    if p.is_null() && size != 0 {
        return libc::ENOMEM;
    }
    unsafe { *out = p };
    0
}

fn page() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// # Safety
/// The C allocator's contract.
#[no_mangle]
pub unsafe extern "C" fn valloc(size: usize) -> *mut c_void {
    unsafe { memalign(page(), size) }
}

/// # Safety
/// The C allocator's contract.
#[no_mangle]
pub unsafe extern "C" fn pvalloc(size: usize) -> *mut c_void {
    let page = page();
    match size.checked_add(page - 1) {
        Some(s) => unsafe { memalign(page, s & !(page - 1)) },
        None => std::ptr::null_mut(),
    }
}

/// # Safety
/// `ptr` is null or a block of this allocator.
#[no_mangle]
pub unsafe extern "C" fn malloc_usable_size(ptr: *mut c_void) -> usize {
    if ptr.is_null() {
        return 0;
    }
    if counting() {
        // What the caller asked for is all it may use.
        return unsafe { (*header(ptr)).size as usize };
    }
    type Usable = unsafe extern "C" fn(*mut c_void) -> usize;
    // SAFETY: glibc's own malloc_usable_size, next after this library.
    unsafe {
        let next = libc::dlsym(libc::RTLD_NEXT, c"malloc_usable_size".as_ptr());
        if next.is_null() {
            return 0;
        }
        std::mem::transmute::<*mut c_void, Usable>(next)(ptr)
    }
}

/// Fills `out` with the counters.
///
/// # Safety
/// `out` points to a writable `Counts`.
#[no_mangle]
pub unsafe extern "C" fn workbook_heap_v1_counts(out: *mut raw::Counts) {
    unsafe { out.write(raw::counts()) }
}

/// Opens a peak frame.
#[no_mangle]
pub extern "C" fn workbook_heap_v1_push_frame() {
    raw::push_frame()
}

/// Closes a peak frame.
#[no_mangle]
pub extern "C" fn workbook_heap_v1_pop_frame() {
    raw::pop_frame()
}

/// Sets this thread's category (`which` 0) or residency (1) tag; returns
/// the previous one.
#[no_mangle]
pub extern "C" fn workbook_heap_v1_swap_tag(which: u32, value: u8) -> u8 {
    raw::swap_local_tag(which, value)
}

/// This thread's category (`which` 0) or residency (1) tag.
#[no_mangle]
pub extern "C" fn workbook_heap_v1_get_tag(which: u32) -> u8 {
    raw::local_tag(which)
}
