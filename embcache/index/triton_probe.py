"""TorchIndex's probe in one kernel (Triton): find, and optionally touch and gather, in a single launch.

In torch ops, :class:`~embcache.index.TorchIndex`'s probe on a GPU is about 30 kernels (the key
hash, the two bucket gathers, the byte-match trick, the slot read), and the lookup's touch and
row gather a dozen more. Each costs a launch and the dispatcher's work on the host: on an H100,
``index.find`` alone took 0.75 ms of host time per batch of 65,536 keys and the whole all-hit
lookup 1.37 ms, against 0.06 ms for an ``index_select`` of the same rows (``bench/profile_gpu.py``).
The host was the limit, whatever the batch. This kernel does the same work in one launch:

- per key: the splitmix64 hash (:func:`embcache.mix64`, in wrapping int64 arithmetic), its two
  buckets (multiply-shift of each 32-bit half, as ``TorchIndex._bucket``), both buckets' keys
  compared, and the slot of the matching entry; a key in neither bucket is searched for in the
  sorted stash (a binary search, only when the stash is not empty);
- ``touch``: ``freq[slot] += inc`` in float32 (an atomic add; every addend of one call is the
  same ``inc``, rounded to float32 as torch's ``index_add_`` rounds it, so the sum does not
  depend on the order) and ``last[slot] = now``; with ``once``, ``last`` is exchanged atomically
  and only an occurrence that found it other than ``now`` adds (one per row and tick);
- ``gather``: the found rows, converted to float32, into ``out`` (absent keys' rows untouched);
- ``count``: the number found, added into a one-element counter (the one host sync is the
  caller's read of it).

The results equal the torch path's bit for bit (the tests compare them). On the CPU the same
kernel runs under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported, as
the test suite does where torch sees no GPU): that is how CI, which has no GPU, tests it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK", "interpreted", "probe"]

BLOCK = 64  # keys per program


def _probe_kernel(keys_ptr, n, tkeys_ptr, tslots_ptr, nb, skeys_ptr, sslots_ptr, n_stash, stash_iters,  # type: ignore[no-untyped-def]
                  freq_ptr, freq_stride, last_ptr, last_stride, inc, now,
                  rows_ptr, row_stride, out_ptr, out_stride, dim,
                  slots_ptr, hits_ptr,
                  W: tl.constexpr, BLOCK: tl.constexpr, DBLOCK: tl.constexpr, STASH: tl.constexpr,
                  TOUCH: tl.constexpr, ONCE: tl.constexpr, GATHER: tl.constexpr, COUNT: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    k = tl.load(keys_ptr + offs, mask=live, other=0)
    # splitmix64's finalizer (embcache._bits.mix64): arithmetic shifts masked to logical ones
    x = k ^ ((k >> 30) & 0x3FFFFFFFF)
    x = x * -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64
    x = x ^ ((x >> 27) & 0x1FFFFFFFFF)
    x = x * -7723592293110705685  # 0x94D049BB133111EB as int64
    x = x ^ ((x >> 31) & 0x1FFFFFFFF)
    b1 = (((x >> 32) & 0xFFFFFFFF) * nb) >> 32
    b2 = ((x & 0xFFFFFFFF) * nb) >> 32
    cols = tl.arange(0, W)
    e1 = tl.load(tkeys_ptr + (b1 * W)[:, None] + cols[None, :], mask=live[:, None], other=0)
    c1 = tl.max(tl.where(e1 == k[:, None], cols[None, :], -1), axis=1)
    e2 = tl.load(tkeys_ptr + (b2 * W)[:, None] + cols[None, :], mask=live[:, None], other=0)
    c2 = tl.max(tl.where(e2 == k[:, None], cols[None, :], -1), axis=1)
    pos = tl.where(c1 >= 0, b1 * W + c1, b2 * W + c2)
    hit = live & ((c1 >= 0) | (c2 >= 0))
    slot = tl.load(tslots_ptr + pos, mask=hit, other=-1).to(tl.int64)
    if STASH:
        # keys in neither bucket: a binary search of the sorted stash keys [0, n_stash)
        need = live & (slot < 0)
        lo = tl.zeros([BLOCK], dtype=tl.int64)
        hi = tl.zeros([BLOCK], dtype=tl.int64) + n_stash
        for _ in range(stash_iters):
            act = need & (lo < hi)
            mid = (lo + hi) >> 1
            v = tl.load(skeys_ptr + mid, mask=act, other=0)
            right = act & (v < k)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(act & (v >= k), mid, hi)
        inb = need & (lo < n_stash)
        v = tl.load(skeys_ptr + lo, mask=inb, other=0)
        found = inb & (v == k)
        slot = tl.where(found, tl.load(sslots_ptr + lo, mask=found, other=-1).to(tl.int64), slot)
        hit = hit | found
    tl.store(slots_ptr + offs, slot, mask=live)
    if TOUCH:
        stamp = tl.full([BLOCK], now, tl.int64)
        if ONCE:
            old = tl.atomic_xchg(last_ptr + slot * last_stride, stamp, mask=hit)
            tl.atomic_add(freq_ptr + slot * freq_stride, tl.full([BLOCK], inc, tl.float32), mask=hit & (old != now))
        else:
            tl.atomic_add(freq_ptr + slot * freq_stride, tl.full([BLOCK], inc, tl.float32), mask=hit)
            tl.store(last_ptr + slot * last_stride, stamp, mask=hit)
    if GATHER:
        dcols = tl.arange(0, DBLOCK)
        for d0 in range(0, dim, DBLOCK):
            d = d0 + dcols
            m = hit[:, None] & (d < dim)[None, :]
            r = tl.load(rows_ptr + (slot * row_stride)[:, None] + d[None, :], mask=m, other=0.0)
            tl.store(out_ptr + (offs * out_stride)[:, None] + d[None, :], r.to(tl.float32), mask=m)
    if COUNT:
        tl.atomic_add(hits_ptr, tl.sum(hit.to(tl.int32), axis=0))


# Arguments that change from call to call: not specialized on (a value of 1 or a multiple of 16
# would otherwise compile another variant).
_DYNAMIC = ("n", "nb", "n_stash", "stash_iters", "inc", "now", "dim", "row_stride", "out_stride")
# Compiled for the GPU; with TRITON_INTERPRET=1 in the environment when triton is first imported,
# run by Triton's interpreter on CPU tensors instead (the test suite's way without a GPU).
_kernel = triton.jit(_probe_kernel, do_not_specialize=list(_DYNAMIC))


def interpreted() -> bool:
    """Whether the kernel runs under Triton's interpreter (on CPU tensors) rather than compiled."""
    return not isinstance(_kernel, triton.JITFunction)


def probe(keys: torch.Tensor, table_keys: torch.Tensor, table_slots: torch.Tensor, n_buckets: int, width: int,
          stash_keys: torch.Tensor, stash_slots: torch.Tensor, *,
          touch: tuple[torch.Tensor, torch.Tensor, float, int, bool] | None = None,
          gather: tuple[torch.Tensor, torch.Tensor] | None = None,
          count: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Slots of ``keys`` in a TorchIndex's tables, in one launch.

    Args:
        keys: int64 [n], contiguous, on the index's device.
        table_keys, table_slots: the flat int64 and int32 [n_buckets * width (+ more)] entry tables.
        n_buckets, width: the table's buckets and entries per bucket.
        stash_keys, stash_slots: the sorted stash (int64, int32 [s]); may be empty.
        touch: ``(freq float32 [cap], last int64 [cap], inc, now, once)``, any stride (a tier's
            are views of its rows' records): count one access per found key (with ``once``, one
            per row whose ``last`` was not ``now``).
        gather: ``(rows [cap, dim], out float32 [n, dim])``, each with unit stride along ``dim``:
            ``out[i] = rows[slot of keys[i]]`` where found.
        count: also return how many keys were found (an int32 [1] tensor on the device).

    Returns:
        (slots int64 [n], -1 where absent; the count or None).
    """
    n = keys.numel()
    device = keys.device
    slots = torch.empty(n, dtype=torch.int64, device=device)
    hits = torch.zeros(1, dtype=torch.int32, device=device) if count else None
    n_stash = int(stash_keys.numel())
    freq, last, inc, now, once = touch if touch is not None else (slots, slots, 0.0, 0, False)
    rows, out = gather if gather is not None else (slots, slots)
    dim = int(out.shape[1]) if gather is not None else 1
    stash_k = stash_keys if n_stash else slots
    stash_s = stash_slots if n_stash else slots
    grid = (triton.cdiv(n, BLOCK),)
    _kernel[grid](
        keys, n, table_keys, table_slots, n_buckets, stash_k, stash_s, n_stash, n_stash.bit_length(),
        freq, freq.stride(0), last, last.stride(0), float(inc), int(now),
        rows, rows.stride(0) if gather is not None else 1, out, out.stride(0) if gather is not None else 1, dim,
        slots, hits if hits is not None else slots,
        W=width, BLOCK=BLOCK, DBLOCK=min(128, triton.next_power_of_2(dim)), STASH=n_stash > 0,
        TOUCH=touch is not None, ONCE=bool(once), GATHER=gather is not None, COUNT=count)
    return slots, hits
