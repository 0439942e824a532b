"""Fused Triton kernels for the 8-bit optimizers: one launch per group of tensors, no vendor-specific code.

Each program takes BLOCKS consecutive 256-element blocks of one tensor (found through a table of block
descriptors built on the host and cached), and in one pass: dequantizes both moments, updates them in
fp32, takes the new absmax of each block, requantizes to the nearest map entry, and updates the
parameter (fp32, bf16 or fp16 storage; fp32 math). The same source compiles for CUDA and ROCm.

Importing this module imports triton; the optimizers import it only when a parameter is on a GPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from toolkit.optim.quant import BLOCK_SIZE, quant_tables

ADAMW, LION = 0, 1
BINARY_SEARCH, ARITHMETIC_GUESS = 0, 1
# Fastest measured on an H200 (bench/optim.py, 16 x 4096x4096 params): 1024 elements per program for fp32
# params, 512 for 16-bit ones; fewer registers per program keep more loads in flight.
DEFAULT_CONFIGS = {
    torch.float32: {"blocks": 4, "num_warps": 4, "quant_search": ARITHMETIC_GUESS},
    torch.bfloat16: {"blocks": 2, "num_warps": 2, "quant_search": ARITHMETIC_GUESS},
    torch.float16: {"blocks": 2, "num_warps": 2, "quant_search": ARITHMETIC_GUESS},
}
CONFIG_OVERRIDE: dict | None = None  # set by tests and benchmarks to try other configs
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
SUPPORTED_DTYPES = tuple(_TL_DTYPES)


@triton.jit
def _guess_code(x, SIGNED: tl.constexpr):
    """A map index within one of the nearest entry's, from the map's structure (7 decades, linear within)."""
    ax = tl.abs(x)
    decade = tl.floor(tl.log2(tl.maximum(ax, 1e-30)) * 0.30102999566398120) + 7.0  # floor(log10(ax)) + 7
    d = tl.minimum(tl.maximum(decade, 0.0), 6.0)
    d_int = d.to(tl.int32)
    scale = tl.exp2((d - 6.0) * 3.3219280948873623)  # 10 ** (d - 6): top of the decade
    if SIGNED:
        count = tl.full(d_int.shape, 1, tl.int32) << d_int
        first = 127 + count
        zero = 127
    else:
        count = tl.full(d_int.shape, 2, tl.int32) << d_int
        first = count - 1
        zero = 0
    # entries sit at the middles of `count` equal bins spanning [0.1, 1] * scale
    k = tl.floor((ax / scale - 0.1) * (count.to(tl.float32) / 0.9)).to(tl.int32)
    k = tl.minimum(tl.maximum(k, 0), count - 1)
    guess = first + k
    guess = tl.where(decade < 0.0, zero, guess)
    guess = tl.where(ax >= 1.0, 255, guess)
    if SIGNED:
        guess = tl.where(x < 0.0, 254 - guess, guess)
    return tl.minimum(tl.maximum(guess, 1), 254)


@triton.jit
def _quantize(x, mid_ptr, SIGNED: tl.constexpr, QUANT_SEARCH: tl.constexpr):
    """Index of the nearest map entry: the number of midpoints below x (exact)."""
    if QUANT_SEARCH == 0:
        code = tl.zeros(x.shape, tl.int32)
        for s in tl.static_range(8):
            probe = tl.load(mid_ptr + code + ((128 >> s) - 1))
            code = tl.where(probe < x, code + (128 >> s), code)
    else:
        guess = _guess_code(x, SIGNED)
        below = tl.load(mid_ptr + guess - 1)
        above = tl.load(mid_ptr + guess)
        code = guess - 1 + (below < x).to(tl.int32) + (above < x).to(tl.int32)
    return code.to(tl.uint8)


@triton.jit
def _load(ptrs, mask, other, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=mask, other=other)
    else:
        return tl.load(ptrs)


@triton.jit
def _store(ptrs, values, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptrs, values, mask=mask)
    else:
        tl.store(ptrs, values)


@triton.jit
def _update_blocks(p_ptr, g_ptr, s1_ptr, s2_ptr, a1_ptr, a2_ptr, start, n,
                   qmap1_ptr, mid1_ptr, qmap2_ptr, mid2_ptr,
                   lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, decay, step_size, correction2,
                   OPTIMIZER: tl.constexpr, PARAM_DTYPE: tl.constexpr, BLOCKS: tl.constexpr,
                   QUANT_SEARCH: tl.constexpr, MASKED: tl.constexpr):
    blocks = start // 256 + tl.arange(0, BLOCKS)
    offs = blocks[:, None] * 256 + tl.arange(0, 256)[None, :]
    mask = offs < n  # used only for the tensor's last chunk: unmasked loads of full chunks vectorize
    bmask = blocks * 256 < n

    g = _load(g_ptr + offs, mask, 0.0, MASKED).to(tl.float32)
    p = _load(p_ptr + offs, mask, 0.0, MASKED).to(tl.float32)
    c1 = _load(s1_ptr + offs, mask, 127, MASKED).to(tl.int32)  # 127: 0.0 in the signed map
    a1 = _load(a1_ptr + blocks, bmask, 0.0, MASKED)
    m = tl.load(qmap1_ptr + c1) * a1[:, None]

    if OPTIMIZER == 0:
        c2 = _load(s2_ptr + offs, mask, 0, MASKED).to(tl.int32)  # 0: 0.0 in the unsigned map
        a2 = _load(a2_ptr + blocks, bmask, 0.0, MASKED)
        v = tl.load(qmap2_ptr + c2) * a2[:, None]
        m = m * beta1 + one_minus_beta1 * g
        v = v * beta2 + one_minus_beta2 * (g * g)
        p = p * decay
        p = p - step_size * (m / (tl.sqrt(v) / correction2 + eps))
        new_a2 = tl.max(v, axis=1)  # v >= 0
        safe2 = tl.where(new_a2 > 0.0, new_a2, 1.0)
        _store(s2_ptr + offs, _quantize(v / safe2[:, None], mid2_ptr, False, QUANT_SEARCH), mask, MASKED)
        _store(a2_ptr + blocks, new_a2, bmask, MASKED)
    else:
        p = p * decay
        u = m * beta1 + g * one_minus_beta1
        p = p - lr * tl.where(u > 0.0, 1.0, tl.where(u < 0.0, -1.0, 0.0))
        m = m * beta2 + g * one_minus_beta2

    new_a1 = tl.max(tl.abs(m), axis=1)
    safe1 = tl.where(new_a1 > 0.0, new_a1, 1.0)
    _store(s1_ptr + offs, _quantize(m / safe1[:, None], mid1_ptr, True, QUANT_SEARCH), mask, MASKED)
    _store(a1_ptr + blocks, new_a1, bmask, MASKED)
    _store(p_ptr + offs, p.to(PARAM_DTYPE), mask, MASKED)


@triton.jit
def _blockwise_8bit_kernel(
    chunk_tensor_ptr, chunk_start_ptr, addrs_ptr, numels_ptr,
    qmap1_ptr, mid1_ptr, qmap2_ptr, mid2_ptr,
    lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, decay, step_size, correction2,
    OPTIMIZER: tl.constexpr, PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr,
    BLOCKS: tl.constexpr, QUANT_SEARCH: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor_ptr + pid)
    start = tl.multiple_of(tl.load(chunk_start_ptr + pid), BLOCKS * 256)
    n = tl.load(numels_ptr + t)
    row = addrs_ptr + t * 6
    # the host sends only 16-byte aligned tensors here: the hints let loads and stores go 16 bytes wide
    p_ptr = tl.multiple_of(tl.load(row + 0).to(tl.pointer_type(PARAM_DTYPE)), 16)
    g_ptr = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(GRAD_DTYPE)), 16)
    s1_ptr = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(tl.uint8)), 16)
    s2_ptr = tl.multiple_of(tl.load(row + 3).to(tl.pointer_type(tl.uint8)), 16)
    a1_ptr = tl.multiple_of(tl.load(row + 4).to(tl.pointer_type(tl.float32)), 16)
    a2_ptr = tl.multiple_of(tl.load(row + 5).to(tl.pointer_type(tl.float32)), 16)
    args = (p_ptr, g_ptr, s1_ptr, s2_ptr, a1_ptr, a2_ptr, start, n, qmap1_ptr, mid1_ptr, qmap2_ptr, mid2_ptr,
            lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, decay, step_size, correction2)
    if start + BLOCKS * 256 <= n:
        _update_blocks(*args, OPTIMIZER, PARAM_DTYPE, BLOCKS, QUANT_SEARCH, False)
    else:
        _update_blocks(*args, OPTIMIZER, PARAM_DTYPE, BLOCKS, QUANT_SEARCH, True)


def is_aligned(*tensors: torch.Tensor) -> bool:
    """True when every tensor starts on a 16-byte boundary (the kernel's vectorized loads assume it)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


class _LaunchTables:
    """Device-side block descriptors and address table for one list of tensors, rebuilt only on change."""

    def __init__(self):
        self._layout_key = None
        self._addr_key = None

    def get(self, params, grads, states, chunk: int, device: torch.device):
        numels = tuple(p.numel() for p in params)
        if self._layout_key != (numels, chunk):
            counts = torch.tensor([-(-n // chunk) for n in numels], dtype=torch.int64)
            chunk_tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), counts)
            firsts = torch.cumsum(counts, 0) - counts
            within = torch.arange(int(counts.sum())) - torch.repeat_interleave(firsts, counts)
            self.chunk_tensor = chunk_tensor.to(device)
            self.chunk_start = (within * chunk).to(device)
            self.numels = torch.tensor(numels, dtype=torch.int64).to(device)
            self._layout_key = (numels, chunk)
        addrs = []
        for p, g, s in zip(params, grads, states):
            s2 = s.get("state2")
            a2 = s.get("absmax2")
            # Lion has one moment: its second-moment slots repeat the first's (16-byte aligned, never used)
            addrs += [p.data_ptr(), g.data_ptr(), s["state1"].data_ptr(), (s2 if s2 is not None else s["state1"]).data_ptr(),
                      s["absmax1"].data_ptr(), (a2 if a2 is not None else s["absmax1"]).data_ptr()]
        key = tuple(addrs)
        if key != self._addr_key:
            host = torch.tensor(addrs, dtype=torch.int64)
            # pinned + non_blocking: the upload is queued on the stream, no host sync
            self.addrs = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
            self._addr_key = key
        return self.chunk_tensor, self.chunk_start, self.addrs, self.numels


def fused_step(optimizer: str, params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
               tables: _LaunchTables, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               step: int, config: dict | None = None):
    """One fused launch updating every (param, grad, 8-bit state) triple; all share dtype, device and step.

    Returns the launched kernel (its n_regs and n_spills say how it compiled)."""
    config = config or CONFIG_OVERRIDE or DEFAULT_CONFIGS[params[0].dtype]
    device = params[0].device
    chunk = config["blocks"] * BLOCK_SIZE
    chunk_tensor, chunk_start, addrs, numels = tables.get(params, grads, states, chunk, device)
    qmap1, mid1 = quant_tables(True, device)
    qmap2, mid2 = quant_tables(False, device)
    if optimizer == "adamw":
        kind, step_size = ADAMW, lr / (1.0 - beta1**step)
        correction2 = math.sqrt(1.0 - beta2**step)
    else:
        kind, step_size, correction2 = LION, lr, 1.0
    return _blockwise_8bit_kernel[(chunk_tensor.numel(),)](
        chunk_tensor, chunk_start, addrs, numels, qmap1, mid1, qmap2, mid2,
        lr, beta1, beta2, 1.0 - beta1, 1.0 - beta2, eps, 1.0 - lr * weight_decay, step_size, correction2,
        OPTIMIZER=kind, PARAM_DTYPE=_TL_DTYPES[params[0].dtype], GRAD_DTYPE=_TL_DTYPES[grads[0].dtype],
        BLOCKS=config["blocks"], QUANT_SEARCH=config["quant_search"], num_warps=config["num_warps"],
    )

