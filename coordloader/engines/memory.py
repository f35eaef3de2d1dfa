"""Fresh destination memory, faulted in ahead of the bytes that land in it.

A tensor from ``torch.empty`` is address space only: the first write to each 4 KiB page
traps into the kernel, which zeroes a page and maps it. For a slice-exact load that trap
is most of the cost on machines where faults are dear (virtual machines), and it cannot
be avoided: every method that returns fresh tensors pays it. What can be avoided is the
trap itself: ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) maps a whole range in one
system call, the kernel's fault path without a user-mode exception per page.

Memory the allocator hands back from an earlier use is mapped already, and populating it
again still walks its page tables (a long-lived process loading twice paid that on every
load). So ``prefault`` first asks the kernel (``mincore``) whether the range's last whole
page is mapped: if it is, the range is taken as reused memory and left alone. A fresh
allocation's last page is never touched first (the allocator writes its bookkeeping at
the front).

``prefault`` is best effort: where the calls are missing (other systems, older kernels) it
does nothing and the reads fault the pages in as before. The bytes a tensor ends up
holding do not depend on it.
"""
from __future__ import annotations

import ctypes
import errno
import sys

PAGE = 4096
# <linux/mman.h>: populate (prefault) page tables writable, faulting in as needed
MADV_POPULATE_WRITE = 23


def _libc(name: str, third):
    """libc's ``name(void *, size_t, third)`` returning int, or None off Linux or where
    libc lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, third]
    f.restype = ctypes.c_int
    return f


_MADVISE = _libc("madvise", ctypes.c_int)
_MINCORE = _libc("mincore", ctypes.c_char_p)
_unsupported = False


def _mapped(page: int) -> bool:
    """Whether the page at ``page`` (page-aligned) is mapped now; False when unknown."""
    if _MINCORE is None:
        return False
    vec = ctypes.create_string_buffer(1)
    return _MINCORE(page, PAGE, vec) == 0 and bool(vec.raw[0] & 1)


def prefault(address: int, nbytes: int) -> bool:
    """Map the whole pages inside ``[address, address + nbytes)`` writable, now, in one
    call. Pages only partly inside are left alone (they may belong to other memory); a
    page already mapped is left as it is. Returns False where nothing was done (no whole
    page inside, the last one mapped already, or the system lacks the call; then it is
    not tried again)."""
    global _unsupported
    lo = (address + PAGE - 1) & ~(PAGE - 1)
    hi = (address + nbytes) & ~(PAGE - 1)
    if hi <= lo or _MADVISE is None or _unsupported or _mapped(hi - PAGE):
        return False
    # ctypes releases the GIL for the call: other reader threads go on meanwhile
    if _MADVISE(lo, hi - lo, MADV_POPULATE_WRITE) != 0:
        # EINVAL: a kernel without it. Anything else (ENOMEM when memory is short) is left
        # to the reads, which fault the same pages and report a real failure as theirs.
        if ctypes.get_errno() == errno.EINVAL:
            _unsupported = True
        return False
    return True


def prefault_tensor(t) -> bool:
    """``prefault`` over a contiguous CPU tensor's bytes."""
    return prefault(t.data_ptr(), t.numel() * t.element_size())
