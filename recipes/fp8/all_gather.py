"""FP8 all-gather of the per-tensor recipes' weights under FSDP2 (`trainer.fsdp_fp8_all_gather=true`; what
Megatron's `fp8_param_gather` does for its own sharded optimizer and FSDP).

Without it FSDP2 all-gathers each layer's weights in BF16 and every FP8 layer then quantizes the gathered weight.
With it, each process quantizes its own FP32 shard with the scale of the whole weight and FSDP2 all-gathers the
FP8 bytes: half the traffic, and no quantization of the gathered weight (torchao's `enable_fsdp_float8_all_gather`
does the same for its own Float8Linear). Two tensor subclasses plug into FSDP2's extension points:

    Fp8ShardedWeight    the FP32 master shard. Every op unwraps it (optimizer, clipping, checkpoints see the plain
                        tensor); `fsdp_pre_all_gather` casts it to E4M3 with the weight's scale and hands FSDP the
                        bytes, `fsdp_post_all_gather` wraps the gathered bytes as
    Fp8GatheredWeight   the unsharded weight as the FP8 linear's GEMMs take it: E4M3 data and its decoding scale,
                        posing as a BF16 tensor of the weight's shape. Fp8Linear uses it as its quantized weight.

The scale of the whole weight, per recipe:
    current scaling   fp8_max / amax(whole FP32 weight): the shards' amaxes, all-reduced (max) once per optimizer
                      step for every layer together (update_all_gather_scales in recipes.fp8.training, after the optimizer step and
                      before the first forward). The FP8 weight is then exactly what one process would quantize
                      from its FP32 weight (the BF16 all-gather quantizes the BF16-rounded weight instead).
    delayed scaling   the layer's weight scale from its amax history. The same all-reduce puts the whole weight's
                      amax into the history's open slot, once per optimizer step as a cached weight's (and as TE
                      records an FP8 weight's amax when it casts the master weight after the optimizer step);
                      the next update_fp8_scaling folds it in (not the all-gather itself: a backward's re-gather
                      must not touch tensors the backward uses).
Block-scaled recipes (blockwise, MXFP8) keep the BF16 all-gather: their weight scales are per block, computed from
the gathered weight.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from recipes.fp8.current_scaling import cast_to_fp8, fp32_quotient
from recipes.fp8.formats import E4M3
from recipes.fp8.tensor import Float8Tensor

# Ops FSDP2 applies to a parameter while sharding and moving it: their results stay master shards.
_KEEPS_SUBCLASS = {
    torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default, torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default, torch.ops.aten.view.default, torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default, torch.ops.aten._pin_memory.default, torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default, torch.ops.aten.detach.default, torch.ops.aten.alias.default,
}
# Ops FSDP2, autograd and torch.compile apply to the gathered weight: each acts on the FP8 data alike.
_GATHERED_VIEWS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.as_strided.default,
                   torch.ops.aten.view.default}


def _wrapper(cls, like: torch.Tensor, dtype: torch.dtype):
    return torch.Tensor._make_wrapper_subclass(
        cls, like.size(), strides=like.stride(), storage_offset=like.storage_offset(), dtype=dtype,
        layout=like.layout, device=like.device, requires_grad=like.requires_grad,
    )


class Fp8ShardedWeight(torch.Tensor):
    """An FP8 linear's FP32 master weight (shard) that FSDP2 all-gathers in E4M3, encoded with `scale` (0-d FP32:
    the layer's buffer holding the whole weight's scale)."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, scale: torch.Tensor):
        return _wrapper(cls, tensor, tensor.dtype)

    def __init__(self, tensor: torch.Tensor, scale: torch.Tensor):
        self._tensor, self._scale = tensor, scale

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        owner = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, Fp8ShardedWeight))
        args, kwargs = pytree.tree_map_only(Fp8ShardedWeight, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEPS_SUBCLASS:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: Fp8ShardedWeight(t, owner._scale), out)

    def __tensor_flatten__(self):
        return ["_tensor", "_scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, spec, outer_size, outer_stride):
        return Fp8ShardedWeight(inner["_tensor"], inner["_scale"])

    def __repr__(self) -> str:
        return f"Fp8ShardedWeight({self._tensor!r})"

    @torch.no_grad()
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        data = cast_to_fp8(self._tensor, self._scale, E4M3)
        # All-gathered as bytes: FSDP packs a layer's parameters into one buffer (bytes whenever dtypes mix), and
        # Gloo has no FP8 type.
        return (data.view(torch.uint8),), (fp32_quotient(1.0, self._scale),)

    @torch.no_grad()
    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (data,), (scale_inv,) = outputs, metadata
        if out is not None:  # later all-gathers refill the first one's data buffer in place
            out._scale_inv = scale_inv  # rebound, not copied into: a backward may hold the old one
            return
        gathered = Fp8GatheredWeight(data.view(E4M3), scale_inv, param_dtype)
        return gathered, (data,)


# Distributed checkpoints store the master shards as they are; loading them (weights_only) needs the class allowed.
torch.serialization.add_safe_globals([Fp8ShardedWeight])


class Fp8GatheredWeight(torch.Tensor):
    """The whole weight in E4M3 with its decoding scale, as FSDP2 hands it to the layer. It poses as a tensor of
    the parameter's dtype (gradients come back in that dtype) but holds no such values: only views, detach and
    Fp8Linear may use it; anything else raises rather than compute with FP8 bytes as if they were BF16."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype):
        return _wrapper(cls, data, dtype)

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype):
        self._data, self._scale_inv = data, scale_inv

    def as_float8(self) -> Float8Tensor:
        return Float8Tensor(self._data, self._scale_inv)

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        if func not in _GATHERED_VIEWS:
            raise NotImplementedError(f"{func} on an FP8 all-gathered weight: only the FP8 linear reads it")
        weight, *rest = args
        return Fp8GatheredWeight(func(weight._data, *rest, **(kwargs or {})), weight._scale_inv, weight.dtype)

    def __tensor_flatten__(self):
        return ["_data", "_scale_inv"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return Fp8GatheredWeight(inner["_data"], inner["_scale_inv"], dtype)

    def __repr__(self) -> str:
        # Metadata only: torch.compile's AOTAutograd prints its inputs' metadata while compiling, with fake tensors
        # that have no values; reading the scale there (.item()) makes Inductor fail, and the compiled blocks fall
        # back to eager around every FP8 linear (docs/results: FSDP2 with FP8 all-gather).
        return f"Fp8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, data={self._data.dtype})"


def local_shard(weight: torch.Tensor) -> torch.Tensor:
    """What this process holds of a parameter: a DTensor's local shard, or the tensor itself."""
    return weight._local_tensor if hasattr(weight, "_local_tensor") else weight


def shard_amax(weight: torch.Tensor) -> torch.Tensor:
    """amax (FP32, 0-d) of this process's shard of an FP8-all-gathered weight (the sharded parameter, between
    steps). An empty shard (uneven sharding) has amax 0."""
    local = local_shard(weight)
    if isinstance(local, Fp8GatheredWeight):
        raise RuntimeError("a weight's shard amax was asked for while FSDP2 holds it unsharded (inside a step)")
    shard = local._tensor
    return shard.abs().amax().float() if shard.numel() else shard.new_zeros((), dtype=torch.float32)
