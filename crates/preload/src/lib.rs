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
//! up, and never changes, so no block ever crosses the two ways (a process
//! a cell starts inherits `EVCXR_IS_RUNTIME` and counts too, in its own
//! counters).
//!
//! Nothing on the allocation path touches a thread-local variable: in a
//! library, those are reached through `__tls_get_addr`, which may itself
//! call `malloc` when libraries with thread-locals of their own are loaded
//! later (evcxr loads one per cell). The thread's tags live in a POSIX
//! thread-specific slot instead (a key below 32, which glibc keeps in the
//! thread's descriptor without allocating).

use std::ffi::c_void;
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU8, Ordering};

use workbook_sdk::meter::{raw, Category, CATEGORIES};

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

/// The largest alignment served (the header's offset is 32 bits).
const MAX_ALIGN: usize = 1 << 31;

const UNDECIDED: u8 = 0;
const PASS: u8 = 1;
const COUNT: u8 = 2;
static MODE: AtomicU8 = AtomicU8::new(UNDECIDED);

/// Whether this process counts: decided once, from its environment as the
/// kernel gave it (no allocation, no C library state); the first decision
/// stands.
fn counting() -> bool {
    match MODE.load(Ordering::Acquire) {
        COUNT => true,
        PASS => false,
        _ => {
            let mode = if asked_to_count() { COUNT } else { PASS };
            match MODE.compare_exchange(UNDECIDED, mode, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => mode == COUNT,
                Err(first) => first == COUNT,
            }
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

/// The thread-specific slot of the tags; `u32::MAX` until the first tag is
/// set, and for good when no key below 32 could be had.
static KEY: AtomicU32 = AtomicU32::new(u32::MAX);
const NO_KEY: u32 = u32::MAX - 1;

/// The key, created on first use (from a tag setter, never from inside the
/// allocator).
fn key() -> Option<libc::pthread_key_t> {
    match KEY.load(Ordering::Acquire) {
        NO_KEY => None,
        u32::MAX => {
            let mut k: libc::pthread_key_t = 0;
            // SAFETY: creates a key with no destructor.
            let made = unsafe { libc::pthread_key_create(&mut k, None) } == 0;
            // A key from 32 on has its slots allocated on first set.
            let k = if made && k < 32 { k } else { NO_KEY };
            match KEY.compare_exchange(u32::MAX, k, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => (k != NO_KEY).then_some(k),
                Err(other) => {
                    if made {
                        // SAFETY: the key just created, unused.
                        unsafe { libc::pthread_key_delete(k) };
                    }
                    (other != NO_KEY).then_some(other)
                }
            }
        }
        k => Some(k),
    }
}

/// This thread's category and residency, packed (`category | residency
/// << 8`); `other` on the device until a tag is set.
fn packed_tags() -> u32 {
    let k = KEY.load(Ordering::Acquire);
    if k >= 32 {
        return Category::Other as u32;
    }
    // SAFETY: a key below 32 this library created; reading it allocates
    // nothing.
    match unsafe { libc::pthread_getspecific(k) } as usize {
        0 => Category::Other as u32,
        v => (v - 1) as u32,
    }
}

/// The tag an allocation made now is counted under.
fn thread_tag() -> u8 {
    let p = packed_tags();
    raw::tag_of((p & 0xff) as u8, (p >> 8) as u8).unwrap_or(Category::Other as u8)
}

fn set_errno(code: libc::c_int) {
    // SAFETY: this thread's errno.
    unsafe { *libc::__errno_location() = code };
}

/// Hands out `size` bytes aligned to `align` (a power of two; 16 and below
/// all mean glibc's own alignment) counted under `tag`.
unsafe fn counted(size: usize, align: usize, zeroed: bool, tag: u8) -> *mut c_void {
    // The caller's block starts right after the header, or, over-aligned,
    // at the first multiple of `align` past it: at most `align` bytes into
    // glibc's 16-aligned block.
    let room = if align > HEADER { align } else { HEADER };
    let Some(outer) = size.checked_add(room) else {
        set_errno(libc::ENOMEM);
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
    let user = if align > HEADER {
        (base as usize + HEADER + align - 1) & !(align - 1)
    } else {
        base as usize + HEADER
    } as *mut u8;
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
    unsafe { counted(size, 0, false, thread_tag()) }
}

/// # Safety
/// The C allocator's contract.
#[no_mangle]
pub unsafe extern "C" fn calloc(n: usize, size: usize) -> *mut c_void {
    if !counting() {
        return unsafe { __libc_calloc(n, size) };
    }
    match n.checked_mul(size) {
        Some(total) => unsafe { counted(total, 0, true, thread_tag()) },
        None => {
            set_errno(libc::ENOMEM);
            std::ptr::null_mut()
        }
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
        return unsafe { counted(size, 0, false, thread_tag()) };
    }
    if size == 0 {
        unsafe { free(ptr) };
        return std::ptr::null_mut();
    }
    let (old, offset, tag) = {
        let h = unsafe { &*header(ptr) };
        (h.size as usize, h.offset as usize, h.tag)
    };
    // A block that grows stays what it was: its tag is kept.
    if offset != HEADER {
        // An over-aligned block: a new one, the bytes copied.
        let new = unsafe { counted(size, 0, false, tag) };
        if !new.is_null() {
            unsafe {
                std::ptr::copy_nonoverlapping(ptr.cast::<u8>(), new.cast(), old.min(size));
                free(ptr);
            }
        }
        return new;
    }
    let Some(outer) = size.checked_add(HEADER) else {
        set_errno(libc::ENOMEM);
        return std::ptr::null_mut();
    };
    let base = unsafe { __libc_realloc(ptr.cast::<u8>().sub(HEADER).cast(), outer) } as *mut u8;
    if base.is_null() {
        // The old block stands, counted as it was.
        return base.cast();
    }
    raw::freed(tag, old as u64);
    raw::allocated(tag, size as u64);
    unsafe {
        let user = base.add(HEADER);
        (*header(user.cast())).size = size as u64;
        user.cast()
    }
}

/// # Safety
/// The C allocator's contract: as glibc's, an alignment that is not a power
/// of two is rounded up to one, and 0 is `malloc`'s.
#[no_mangle]
pub unsafe extern "C" fn memalign(align: usize, size: usize) -> *mut c_void {
    if !counting() {
        return unsafe { __libc_memalign(align, size) };
    }
    let align = align.max(1);
    if align > MAX_ALIGN {
        set_errno(libc::ENOMEM);
        return std::ptr::null_mut();
    }
    unsafe { counted(size, align.next_power_of_two(), false, thread_tag()) }
}

/// # Safety
/// The C allocator's contract.
#[no_mangle]
pub unsafe extern "C" fn aligned_alloc(align: usize, size: usize) -> *mut c_void {
    unsafe { memalign(align, size) }
}

/// # Safety
/// The C allocator's contract (errno is left as it was).
#[no_mangle]
pub unsafe extern "C" fn posix_memalign(
    out: *mut *mut c_void,
    align: usize,
    size: usize,
) -> libc::c_int {
    if !align.is_power_of_two() || !align.is_multiple_of(std::mem::size_of::<usize>()) {
        return libc::EINVAL;
    }
    let saved = unsafe { *libc::__errno_location() };
    let p = unsafe { memalign(align, size) };
    set_errno(saved);
    if p.is_null() {
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
/// The C allocator's contract: whole pages, one at least.
#[no_mangle]
pub unsafe extern "C" fn pvalloc(size: usize) -> *mut c_void {
    let page = page();
    match size.max(1).checked_add(page - 1) {
        Some(s) => unsafe { memalign(page, s & !(page - 1)) },
        None => {
            set_errno(libc::ENOMEM);
            std::ptr::null_mut()
        }
    }
}

/// glibc's `malloc_usable_size`, looked up once.
static NEXT_USABLE: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

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
    let mut next = NEXT_USABLE.load(Ordering::Acquire);
    if next.is_null() {
        // SAFETY: glibc's own malloc_usable_size, next after this library.
        next = unsafe { libc::dlsym(libc::RTLD_NEXT, c"malloc_usable_size".as_ptr()) };
        if next.is_null() {
            return 0;
        }
        NEXT_USABLE.store(next, Ordering::Release);
    }
    // SAFETY: the symbol has this signature.
    unsafe { std::mem::transmute::<*mut c_void, Usable>(next)(ptr) }
}

/// The size of the `Counts` this library fills.
#[no_mangle]
pub extern "C" fn workbook_heap_v2_layout() -> usize {
    std::mem::size_of::<raw::Counts>()
}

/// Whether this process is counted.
#[no_mangle]
pub extern "C" fn workbook_heap_v2_counting() -> bool {
    counting()
}

/// Fills `out` with the counters.
///
/// # Safety
/// `out` points to a writable `Counts` of [`workbook_heap_v2_layout`]
/// bytes.
#[no_mangle]
pub unsafe extern "C" fn workbook_heap_v2_counts(out: *mut raw::Counts) {
    unsafe { out.write(raw::counts()) }
}

/// Opens a peak frame; false when frames already nest too deep.
#[no_mangle]
pub extern "C" fn workbook_heap_v2_push_frame() -> bool {
    raw::push_frame()
}

/// Closes a peak frame.
#[no_mangle]
pub extern "C" fn workbook_heap_v2_pop_frame() {
    raw::pop_frame()
}

/// Sets this thread's category (`which` 0) or residency (1) tag; returns
/// the previous one. A value out of range is not set.
#[no_mangle]
pub extern "C" fn workbook_heap_v2_swap_tag(which: u32, value: u8) -> u8 {
    let packed = packed_tags();
    let (category, residency) = ((packed & 0xff) as u8, (packed >> 8) as u8);
    let (new, previous) = match which {
        0 => ((value, residency), category),
        _ => ((category, value), residency),
    };
    if raw::tag_of(new.0, new.1).is_none() {
        return previous;
    }
    if let Some(k) = key() {
        let v = (u32::from(new.0) | (u32::from(new.1) << 8)) as usize + 1;
        // SAFETY: a key below 32 this library created: setting it
        // allocates nothing.
        unsafe { libc::pthread_setspecific(k, v as *const c_void) };
    }
    previous
}

/// This thread's category (`which` 0) or residency (1) tag.
#[no_mangle]
pub extern "C" fn workbook_heap_v2_get_tag(which: u32) -> u8 {
    let packed = packed_tags();
    if which == 0 {
        (packed & 0xff) as u8
    } else {
        (packed >> 8) as u8
    }
}

const _: () = assert!(CATEGORIES < 256);
