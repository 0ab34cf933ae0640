"""Delayed scaling's update after each micro-batch (recipes.fp8.delayed_scaling) in one Triton kernel for every
layer of the model, which it finds through a table of the state buffers' addresses, as TE's `kernel_bulk` does:

    close_slots(buffers, ...)                             one launch: read each open slot, move the windows on,
                                                          write the new scales (one process)
    open_slots(buffers), all-reduce, close_slots(..., reduced)    two launches around the collective (data parallel)

The eager update launched some seventy kernels per micro-batch and Inductor's some fifty (a write per state
buffer); on a GPU the host cannot launch them as fast as the GPU runs them. The FP32 operations are the reference
update's (recipes.fp8.delayed_scaling._close_slots: the same window, NaN dropped from its max, the quotient
correctly rounded), so the histories and scales are the same bits; tests/test_te_parity.py checks both against
TE's rule, this kernel under Triton's CPU interpreter there and on the GPU in tests/test_gpu.py.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

# Globals a Triton kernel reads must be constexprs; Python code reads their `.value`.
ROLES = tl.constexpr(3)  # input, weight, gradient: the rows of each layer's history
GRAD = tl.constexpr(2)  # the role whose open slot is the grad_amax buffer (recipes.fp8.delayed_scaling says why)
# Every layer's (amax_history, grad_amax, scale, nonfinite) buffers, one list per kind.
StateBuffers = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]


@triton.jit
def _address(table, layer):
    return tl.load(table + layer).to(tl.pointer_type(tl.float32))


@triton.jit
def _nonfinite(x):
    return ((x != x) | (tl.abs(x) == float("inf"))).to(tl.float32)


@triton.jit
def _open_slots_kernel(histories, grad_amaxes, nonfinites, out, layers, HISTORY: tl.constexpr):
    """out (2, layers, roles): each open slot's amax, and the non-finite flags with that amax's folded in."""
    layer = tl.program_id(0)
    role = tl.arange(0, 4)
    mask = role < GRAD
    last = tl.load(_address(histories, layer) + role * HISTORY, mask=mask)
    last = tl.where(role == GRAD, tl.load(_address(grad_amaxes, layer)), last)
    mask = role < ROLES
    flags = tl.maximum(tl.load(_address(nonfinites, layer) + role, mask=mask), _nonfinite(last))
    tl.store(out + layer * ROLES + role, last, mask=mask)
    tl.store(out + (layers + layer) * ROLES + role, flags, mask=mask)


@triton.jit
def _close_slots_kernel(histories, grad_amaxes, scales, nonfinites, reduced, layers, scaled_max_input,
                        scaled_max_weight, scaled_max_grad, HISTORY: tl.constexpr, REDUCED: tl.constexpr,
                        MOST_RECENT: tl.constexpr, BLOCK: tl.constexpr):
    """One (layer, role): with `last` its amax of this micro-batch (reduced over the ranks where REDUCED), the
    history [open, oldest, ..., newest] becomes [0, ..., newest, last] and the scale scaled_max / amax where
    `last` is not 0; else both stay. The gradient's open slot, grad_amax, is zeroed."""
    layer, role = tl.program_id(0), tl.program_id(1)
    history = _address(histories, layer) + role * HISTORY
    grad_amax = _address(grad_amaxes, layer)
    nonfinite = _address(nonfinites, layer) + role
    if REDUCED:
        last = tl.load(reduced + layer * ROLES + role)
        flag = tl.load(reduced + (layers + layer) * ROLES + role)
    else:
        last = tl.where(role == GRAD, tl.load(grad_amax), tl.load(history))
        flag = tl.maximum(tl.load(nonfinite), _nonfinite(last))
    i = tl.arange(0, BLOCK)
    window = tl.load(history + 1 + i, mask=i < HISTORY - 1, other=0.0)  # the last HISTORY amaxes, `last` newest
    window = tl.where(i == HISTORY - 1, last, window)
    if MOST_RECENT:
        amax = last
    else:
        amax = tl.max(tl.where(window != window, 0.0, window), 0)  # TE's fmaxf drops NaN
    moves = last != 0  # NaN moves
    amax = tl.where(moves, amax, 0.0)
    scaled_max = tl.where(role == 0, scaled_max_input, tl.where(role == 1, scaled_max_weight, scaled_max_grad))
    usable = (amax == amax) & (amax != float("inf")) & (amax > 0)
    scale_at = _address(scales, layer) + role
    scale = tl.where(usable, tl.div_rn(scaled_max, tl.where(usable, amax, 1.0)), tl.load(scale_at))
    scale = tl.where(tl.abs(scale) == float("inf"), 3.4028234663852886e38, scale)
    tl.debug_barrier()  # every thread has read the history before any moves it
    tl.store(history + i, tl.where(i == 0, 0.0, window), mask=tl.where(moves, i < HISTORY, False))
    tl.store(scale_at, scale)
    tl.store(nonfinite, flag)
    tl.store(grad_amax, 0.0, mask=role == GRAD)


# Address tables by (history length, device, addresses): built and checked once per set of buffers (they stay
# put in training), not in every micro-batch.
_TABLES: dict[tuple, torch.Tensor] = {}


def _table(buffers: StateBuffers) -> tuple[int, torch.Tensor]:
    """(the history length, a (4, layers) table of the addresses of `buffers`' four kinds, on their device)."""
    histories = buffers[0]
    key = (histories[0].shape[1], histories[0].device, tuple(t.data_ptr() for kind in buffers for t in kind))
    if key not in _TABLES:
        _check(buffers)
        if len(_TABLES) >= 16:
            _TABLES.clear()
        _TABLES[key] = torch.tensor(key[2], dtype=torch.int64, device=key[1]).view(len(buffers), -1)
    return key[0], _TABLES[key]


def _check(buffers: StateBuffers) -> None:
    """That the buffers are laid out as the kernels address them."""
    roles, length = ROLES.value, buffers[0][0].shape[1]
    for history, grad_amax, scale, nonfinite in zip(*buffers):
        if history.shape != (roles, length) or grad_amax.shape != (1,) or scale.shape != nonfinite.shape != (roles,):
            raise ValueError(f"delayed scaling states of different shapes: {tuple(history.shape)} after "
                             f"{(roles, length)}")
        if not all(t.is_contiguous() and t.dtype == torch.float32 for t in (history, grad_amax, scale, nonfinite)):
            raise ValueError("delayed scaling's update kernel needs contiguous FP32 state buffers")


def open_slots(buffers: StateBuffers) -> torch.Tensor:
    """(2, layers, roles): the open slots' amaxes and the non-finite flags, for the all-reduce."""
    length, (histories, grad_amaxes, _, nonfinites) = _table(buffers)
    layers = histories.shape[0]
    out = torch.empty((2, layers, ROLES.value), dtype=torch.float32, device=histories.device)
    _open_slots_kernel[(layers,)](histories, grad_amaxes, nonfinites, out, layers, HISTORY=length)
    return out


def close_slots(buffers: StateBuffers, scaled_maxes: tuple[float, float, float], most_recent: bool,
                reduced: Optional[torch.Tensor] = None) -> None:
    """Update every layer's history, scale and non-finite flags in place, and zero the gradients' open slots.
    `reduced`: open_slots' output after the all-reduce; None reads the open slots themselves (one process)."""
    length, tables = _table(buffers)
    layers = tables.shape[1]
    _close_slots_kernel[(layers, ROLES.value)](
        *tables, tables[0] if reduced is None else reduced, layers, *scaled_maxes, HISTORY=length,
        REDUCED=reduced is not None, MOST_RECENT=most_recent, BLOCK=triton.next_power_of_2(length),
    )
