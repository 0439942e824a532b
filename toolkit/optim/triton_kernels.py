"""Fused Triton kernels for the 8-bit optimizers: one launch per group of tensors, no vendor-specific code.

Each program takes BLOCKS consecutive 256-element blocks of one tensor (found through a table of block
descriptors built on the host and cached), and in one pass: dequantizes both moments, updates them in
fp32, updates the parameter (fp32, bf16 or fp16 storage; fp32 math), takes the new absmax of each block
and requantizes to the nearest map entry. The same source compiles for CUDA and ROCm.

The step is bound by instructions, not memory. Loads from the 256-entry maps (a gather per value, and
two per code for a guess-and-refine search) also made Triton move every tensor through shared memory into
a second register layout: 218-229 instructions per element (sm_90 SASS, Triton 3.6). So by default codes
and values are computed from the maps' structure (quant_arith.py: a chain of compares and selects per
decade, then a fused multiply-add): 124-126. The midpoint table is read only on a first step, by the
programs that hold a value next to a midpoint.

Nothing the launch needs is read back to the host: the bias corrections come from the step counts on the device
(one pair per tensor, computed by `adam_scales`), and every program first reads GradScaler's `found_inf`,
returning at once when it is set, so a skipped step writes nothing.

Importing this module imports triton; the optimizers import it only when a parameter is on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from toolkit.optim.quant import BLOCK_SIZE, quant_tables
from toolkit.optim.quant_arith import NEAR_BOUNDARY, POW5_SLOPE, clamp_line, dequant_constants, quantize_steps
from toolkit.optim.reference import adam_step_scales

ADAMW, LION = 0, 1
# config["quant_search"]: BINARY_SEARCH over the midpoint table (exact, slow) or AFFINE (quant_arith);
# config["dequant"]: TABLE (the map entry, exact) or AFFINE (within 3 ulps); config["exact_ties"]: check
# values next to a midpoint against the table (default: on the first step only, see fused_step)
BINARY_SEARCH, AFFINE = 0, 1
TABLE = 0
# One 256-element block per single-warp program: fastest for bf16, within 5% for fp32 on an H200
# (bench/optim_sweep.py; docs/optimizers.md)
DEFAULT_CONFIGS = {
    dtype: {"blocks": 1, "num_warps": 1, "quant_search": AFFINE, "dequant": AFFINE}
    for dtype in (torch.float32, torch.bfloat16, torch.float16)
}
CONFIG_OVERRIDE: dict | None = None  # set by tests and benchmarks to try other configs
# quant_arith's constants, by signedness (0: signed, 1: unsigned)
_QUANT_STEPS = tl.constexpr((quantize_steps(True), quantize_steps(False)))
_CLAMP_LINES = tl.constexpr((clamp_line(True), clamp_line(False)))
_DEQUANT_CONSTANTS = tl.constexpr((dequant_constants(True), dequant_constants(False)))
_POW5_SLOPE = tl.constexpr(POW5_SLOPE)
_NEAR_BOUNDARY = tl.constexpr(NEAR_BOUNDARY)
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
SUPPORTED_DTYPES = tuple(_TL_DTYPES)


@triton.jit
def _code_position(x, SIGNED: tl.constexpr):
    """quant_arith.code_position: its floor is the code of x, an integer is a midpoint. The decade's
    constants come from a chain of compares and selects: no memory traffic, no layout change."""
    steps = _QUANT_STEPS[0 if SIGNED else 1]
    line = _CLAMP_LINES[0 if SIGNED else 1]
    ax = tl.abs(x)
    a = tl.full(x.shape, steps[0], tl.float32)
    c = tl.full(x.shape, steps[1], tl.float32)
    for i in tl.static_range(2, len(steps) - 1, 3):
        hit = ax > steps[i]
        a = tl.where(hit, steps[i + 1], a)
        c = tl.where(hit, steps[i + 2], c)
    z = tl.minimum(tl.fma(ax, a, c), tl.fma(c, line[0], line[1]))
    z = tl.where(x > steps[len(steps) - 1], 255.5, z)
    if SIGNED:
        z = tl.where(x < 0.0, 255.0 - z, z)
    return z


@triton.jit
def _near_midpoint(z):
    return tl.abs(z - tl.floor(z + 0.5)) < _NEAR_BOUNDARY


@triton.jit
def _checked_position(z, unscaled, absmax, inv_absmax, mid_ptr):
    """z, with the value compared with the map's midpoint where z is next to one (then z = code + 0.5)."""
    nearest = tl.floor(z + 0.5)
    below = tl.minimum(tl.maximum(nearest.to(tl.int32) - 1, 0), 254)
    q = unscaled / absmax  # a division, not the caller's product: that product need not live this long
    exact = tl.fma(tl.fma(-q, absmax, unscaled), inv_absmax, q)  # correctly rounded
    mid = tl.load(mid_ptr + below)  # unmasked: a mask would move the near flags to the load's layout early
    checked = below.to(tl.float32) + tl.where(mid < exact, 1.5, 0.5)
    return tl.where(tl.abs(z - nearest) < _NEAR_BOUNDARY, checked, z)


@triton.jit
def _quantize_bsearch(unscaled, absmax, inv_absmax, mid_ptr):
    """The number of midpoints below unscaled / absmax by binary search: 8 dependent table loads, exact."""
    x = unscaled * inv_absmax
    x = tl.fma(tl.fma(-x, absmax, unscaled), inv_absmax, x)  # unscaled / absmax, correctly rounded
    code = tl.zeros(x.shape, tl.int32)
    for s in tl.static_range(8):
        probe = tl.load(mid_ptr + code + ((128 >> s) - 1))
        code = tl.where(probe < x, code + (128 >> s), code)
    return code


@triton.jit
def _dequantize(codes, qmap_ptr, SIGNED: tl.constexpr, DEQUANT: tl.constexpr):
    """Map entry of each int32 code: a table load, or quant_arith.dequantize_arith's arithmetic."""
    if DEQUANT == 0:
        return tl.load(qmap_ptr + codes)
    else:
        p, q, r, x0 = _DEQUANT_CONSTANTS[0 if SIGNED else 1]
        j = (codes - 127 if SIGNED else codes + 1).to(tl.float32)
        j0_bits = j.to(tl.int32, bitcast=True) & 0x7F800000
        j0 = j0_bits.to(tl.float32, bitcast=True)  # 2**floor(log2|j|): j of the decade's first code
        pow5 = tl.floor(tl.exp2(tl.fma(j0_bits.to(tl.float32), _POW5_SLOPE, x0)) + 0.5)  # 5**decade, exact
        value = tl.minimum(pow5 * tl.fma(tl.abs(j) - j0, p, tl.fma(j0, q, r)), 1.0)
        if SIGNED:  # the sign of code - 127
            value = (value.to(tl.int32, bitcast=True) | (j.to(tl.int32, bitcast=True) & -2147483648)).to(
                tl.float32, bitcast=True)
        return value


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
def _update_blocks(p_ptr, g_ptr, s1_ptr, s2_ptr, a1_ptr, a2_ptr, rem,
                   qmap1_ptr, mid1_ptr, qmap2_ptr, mid2_ptr,
                   lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, decay, step_size, inv_correction2,
                   inv_scale, OPTIMIZER: tl.constexpr, PARAM_DTYPE: tl.constexpr, BLOCKS: tl.constexpr,
                   QUANT_SEARCH: tl.constexpr, DEQUANT: tl.constexpr, EXACT_TIES: tl.constexpr,
                   UNSCALE: tl.constexpr, MASKED: tl.constexpr):
    # pointers start at this program's first block: 32-bit offsets, `rem` elements left in the tensor
    blocks = tl.arange(0, BLOCKS)
    offs = blocks[:, None] * 256 + tl.arange(0, 256)[None, :]
    mask = offs < rem  # used only for the tensor's last chunk: unmasked loads of full chunks vectorize
    bmask = blocks * 256 < rem

    g = _load(g_ptr + offs, mask, 0.0, MASKED).to(tl.float32)
    if UNSCALE:  # gradients of a scaled loss that GradScaler did not unscale: as its unscale_ would
        g = g * inv_scale
    p = _load(p_ptr + offs, mask, 0.0, MASKED).to(tl.float32)
    c1 = _load(s1_ptr + offs, mask, 127, MASKED).to(tl.int32)  # 127: 0.0 in the signed map
    a1 = _load(a1_ptr + blocks, bmask, 0.0, MASKED)
    m = _dequantize(c1, qmap1_ptr, True, DEQUANT)

    if OPTIMIZER == 0:
        c2 = _load(s2_ptr + offs, mask, 0, MASKED).to(tl.int32)  # 0: 0.0 in the unsigned map
        a2 = _load(a2_ptr + blocks, bmask, 0.0, MASKED)
        v = _dequantize(c2, qmap2_ptr, False, DEQUANT)
        # the betas ride on the per-block scales: one multiply per block instead of per element
        m = m * (a1 * beta1)[:, None] + one_minus_beta1 * g
        v = v * (a2 * beta2)[:, None] + (one_minus_beta2 * g) * g
        p = p * decay
        p = p - step_size * (m / (tl.sqrt(v) * inv_correction2 + eps))
    else:
        m = m * a1[:, None]
        p = p * decay
        u = m * beta1 + g * one_minus_beta1
        p = p - lr * tl.where(u > 0.0, 1.0, tl.where(u < 0.0, -1.0, 0.0))
        m = m * beta2 + g * one_minus_beta2
        v = m  # unused: Lion has one moment
    _store(p_ptr + offs, p.to(PARAM_DTYPE), mask, MASKED)  # first, so nothing of p lives across branches

    # one division per block, a multiply per element (the exact quotient only next to a midpoint)
    new_a1 = tl.max(tl.abs(m), axis=1)
    safe1 = tl.where(new_a1 > 0.0, new_a1, 1.0)[:, None]
    inv1 = 1.0 / safe1
    new_a2 = tl.max(v, axis=1)  # v >= 0
    safe2 = tl.where(new_a2 > 0.0, new_a2, 1.0)[:, None]
    inv2 = 1.0 / safe2
    if QUANT_SEARCH == 0:
        code1 = _quantize_bsearch(m, safe1, inv1, mid1_ptr)
        code2 = _quantize_bsearch(v, safe2, inv2, mid2_ptr) if OPTIMIZER == 0 else code1
    else:
        z1 = _code_position(m * inv1, True)
        near = _near_midpoint(z1)
        z2 = z1
        if OPTIMIZER == 0:
            z2 = _code_position(v * inv2, False)
            near = near | _near_midpoint(z2)
        # rare (5% of programs, half of them on a first step from 16-bit grads): only then the midpoint
        # table, in a layout of its own
        if EXACT_TIES:
            if tl.max(near.to(tl.int32)) > 0:
                z1 = _checked_position(z1, m, safe1, inv1, mid1_ptr)
                if OPTIMIZER == 0:
                    z2 = _checked_position(z2, v, safe2, inv2, mid2_ptr)
        code1 = z1.to(tl.int32)  # z >= 0: truncation is floor
        code2 = z2.to(tl.int32)
    if OPTIMIZER == 0:
        _store(s2_ptr + offs, code2.to(tl.uint8), mask, MASKED)
        _store(a2_ptr + blocks, new_a2, bmask, MASKED)
    _store(s1_ptr + offs, code1.to(tl.uint8), mask, MASKED)
    _store(a1_ptr + blocks, new_a1, bmask, MASKED)


@triton.jit
def _blockwise_8bit_kernel(
    chunk_tensor_ptr, chunk_start_ptr, addrs_ptr, numels_ptr, scales_ptr, found_inf_ptr, inv_scale_ptr,
    qmap1_ptr, mid1_ptr, qmap2_ptr, mid2_ptr,
    lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, decay,
    OPTIMIZER: tl.constexpr, PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr,
    BLOCKS: tl.constexpr, QUANT_SEARCH: tl.constexpr, DEQUANT: tl.constexpr, EXACT_TIES: tl.constexpr,
    UNSCALE: tl.constexpr,
):
    # GradScaler's found_inf (a zero when none was given): anything but 0 (NaN too) skips the step, every
    # program leaving its blocks as they were
    if tl.load(found_inf_ptr) == 0.0:
        pid = tl.program_id(0)
        t = tl.load(chunk_tensor_ptr + pid)
        start = tl.multiple_of(tl.load(chunk_start_ptr + pid), BLOCKS * 256)
        rem = tl.load(numels_ptr + t) - start
        row = addrs_ptr + t * 6
        # the host sends only 16-byte aligned tensors here: the hints let loads and stores go 16 bytes wide
        p_ptr = tl.multiple_of(tl.load(row + 0).to(tl.pointer_type(PARAM_DTYPE)), 16) + start
        g_ptr = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(GRAD_DTYPE)), 16) + start
        s1_ptr = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(tl.uint8)), 16) + start
        s2_ptr = tl.multiple_of(tl.load(row + 3).to(tl.pointer_type(tl.uint8)), 16) + start
        a1_ptr = tl.multiple_of(tl.load(row + 4).to(tl.pointer_type(tl.float32)), 16) + start // 256
        a2_ptr = tl.multiple_of(tl.load(row + 5).to(tl.pointer_type(tl.float32)), 16) + start // 256
        if OPTIMIZER == 0:  # this tensor's lr / (1 - beta1**step) and 1 / sqrt(1 - beta2**step) (adam_scales)
            step_size = tl.load(scales_ptr + 2 * t)
            inv_correction2 = tl.load(scales_ptr + 2 * t + 1)
        else:
            step_size = lr
            inv_correction2 = 1.0
        if UNSCALE:
            inv_scale = tl.load(inv_scale_ptr)
        else:
            inv_scale = 1.0
        args = (p_ptr, g_ptr, s1_ptr, s2_ptr, a1_ptr, a2_ptr, rem, qmap1_ptr, mid1_ptr, qmap2_ptr, mid2_ptr,
                lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, decay, step_size, inv_correction2, inv_scale)
        if rem >= BLOCKS * 256:
            _update_blocks(*args, OPTIMIZER, PARAM_DTYPE, BLOCKS, QUANT_SEARCH, DEQUANT, EXACT_TIES, UNSCALE, False)
        else:
            _update_blocks(*args, OPTIMIZER, PARAM_DTYPE, BLOCKS, QUANT_SEARCH, DEQUANT, EXACT_TIES, UNSCALE, True)


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


_zeros: dict[torch.device, torch.Tensor] = {}  # found_inf when none is given, per device


def adam_scales(steps: torch.Tensor, lr: float, beta1: float, beta2: float) -> torch.Tensor:
    """(n, 2) fp32: lr / (1 - beta1**step) and 1 / sqrt(1 - beta2**step) for n step counts, computed on their
    device in fp64 as the host would compute them, and rounded once to fp32 (the kernel's arithmetic)."""
    step_size, correction2 = adam_step_scales(steps, lr, beta1, beta2)
    return torch.stack([step_size, 1.0 / correction2], dim=1).float()


def fused_step(optimizer: str, params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
               tables: _LaunchTables, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               found_inf: torch.Tensor | None = None, inv_scale: torch.Tensor | None = None, first: bool = False,
               config: dict | None = None):
    """One fused launch updating every (param, grad, 8-bit state) triple; all share dtype and device.

    Each state's "step" is a 0-dim tensor on the device, already counting this step. found_inf: None, or a 0-dim
    fp32 tensor on the device; anything but 0 makes the launch change nothing. inv_scale: 1 / GradScaler's scale
    when the gradients are still scaled, else None. first: these states were created for this step.
    Returns the launched kernel (its n_regs and n_spills say how it compiled)."""
    config = config or CONFIG_OVERRIDE or DEFAULT_CONFIGS[params[0].dtype]
    # The first step quantizes (1 - beta) * grad / max|(1 - beta) * grad|: with 16-bit grads, ratios that sit
    # exactly on the map's midpoints are common, and the affine form alone may put them on the wrong side
    # (0.05% of codes). From then on values are generic and its rare +-1 codes (1e-5) cost less than the
    # check, which takes about 15% of a step. The host knows only which states are new, not whether their
    # first step is skipped on the device: after a skipped first step the next one goes unchecked.
    device = params[0].device
    chunk = config["blocks"] * BLOCK_SIZE
    chunk_tensor, chunk_start, addrs, numels = tables.get(params, grads, states, chunk, device)
    qmap1, mid1 = quant_tables(True, device)
    qmap2, mid2 = quant_tables(False, device)
    if found_inf is None:
        found_inf = _zeros.get(device)
        if found_inf is None:
            found_inf = _zeros[device] = torch.zeros((), device=device)
    if optimizer == "adamw":
        kind, scales = ADAMW, adam_scales(torch.stack([s["step"] for s in states]), lr, beta1, beta2)
    else:
        kind, scales = LION, numels  # Lion has no bias correction: the kernel reads no scales
    unscale = inv_scale is not None
    return _blockwise_8bit_kernel[(chunk_tensor.numel(),)](
        chunk_tensor, chunk_start, addrs, numels, scales, found_inf,
        inv_scale if unscale else found_inf,  # without UNSCALE the kernel does not read it
        qmap1, mid1, qmap2, mid2,
        lr, beta1, beta2, 1.0 - beta1, 1.0 - beta2, eps, 1.0 - lr * weight_decay,
        OPTIMIZER=kind, PARAM_DTYPE=_TL_DTYPES[params[0].dtype], GRAD_DTYPE=_TL_DTYPES[grads[0].dtype],
        BLOCKS=config["blocks"], QUANT_SEARCH=config["quant_search"], DEQUANT=config["dequant"],
        EXACT_TIES=config.get("exact_ties", first), UNSCALE=unscale, num_warps=config["num_warps"],
    )

