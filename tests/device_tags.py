"""A device mix-up detector that runs on the CPU: ``FakeDeviceMode``.

Under the mode every tensor still lives in host memory, but a tensor the code asks to put on
``cuda`` (a factory with ``device="cuda"``, ``.to("cuda")``, ``.cuda()``) is *tagged*, and so is
every result of an op on tagged tensors. An op that mixes a tagged tensor with an untagged one
raises ``DeviceMixError``, as CUDA would. ``.device`` of a tagged tensor reports ``cuda:0``, so
code that builds tensors ``device=x.device`` gets tagged tensors too. Excepted, as on CUDA:
0-dim tensors (scalars), ``copy_`` / ``.to`` across devices, and ``.cpu()`` (which untags).
``num_syncs`` counts the reads of device values on the host (``.tolist()``, ``.item()``, ``.cpu()``...),
and the ops whose output size CUDA must read back (``bincount``, ``nonzero``, boolean-mask indexing...):
each is a device-to-host sync on a real GPU, and fails a CUDA graph capture.

Tags follow the storage, so views and ``nn.Parameter`` wrappers of a tagged tensor stay tagged.
The mode keeps every tagged tensor alive until it exits, so a freed storage's address is never
reused by an untagged tensor while it runs.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

FAKE = torch.device("cuda", 0)
_CROSS_DEVICE_OK = {torch.Tensor.copy_, torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda,
                    torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.__repr__,
                    torch.Tensor.__format__, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
                    torch.Tensor.__index__, torch.Tensor.__len__, torch.Tensor.data_ptr,
                    torch.Tensor.untyped_storage, torch.Tensor.__reduce_ex__, torch._has_compatible_shallow_copy_type}

_HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
               torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}
# ops whose output size depends on the values, so CUDA reads them back before allocating the output:
# bincount (its largest id), nonzero, unique, masked_select, repeat_interleave by a tensor without output_size
_SIZE_FROM_VALUES = {torch.bincount, torch.Tensor.bincount, torch.nonzero, torch.Tensor.nonzero, torch.argwhere,
                     torch.Tensor.argwhere, torch.unique, torch.Tensor.unique, torch.unique_consecutive,
                     torch.Tensor.unique_consecutive, torch.masked_select, torch.Tensor.masked_select}
_REPEATS = {torch.repeat_interleave, torch.Tensor.repeat_interleave}


class DeviceMixError(RuntimeError):
    pass


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, int):
        return True
    return isinstance(device, str) and device.startswith("cuda")


class FakeDeviceMode(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self._storages: set[int] = set()  # data_ptr of tagged storages
        self._empties: set[int] = set()  # id() of tagged zero-size tensors
        self._keep: list[torch.Tensor] = []
        self.num_checked_ops = 0
        self.num_syncs = 0  # reads of a device tensor's values on the host (.tolist(), .item(), .cpu(), ...)

    # ---- tags ----
    def is_tagged(self, t: torch.Tensor) -> bool:
        if t.device.type == "meta":
            return False
        with torch._C.DisableTorchFunction():
            ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        return (ptr in self._storages) if ptr else (id(t) in self._empties)

    def _tag(self, t: torch.Tensor) -> None:
        with torch._C.DisableTorchFunction():
            if t.device.type == "meta":
                return
            ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        if ptr:
            self._storages.add(ptr)
        else:
            self._empties.add(id(t))
        self._keep.append(t)

    # ---- the hook ----
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name == "__set__":  # a property set (``param.data = t``): the tags follow the storage
            return func(*args, **kwargs)
        if name == "__get__":  # a property of a tensor
            owner = getattr(func, "__self__", None)
            prop = getattr(owner, "__name__", "")
            if prop in ("device", "is_cuda", "is_cpu") and args and isinstance(args[0], torch.Tensor):
                tagged = self.is_tagged(args[0])
                if prop == "device":
                    return FAKE if tagged else func(*args, **kwargs)
                return tagged if prop == "is_cuda" else not tagged
            return func(*args, **kwargs)
        if func is torch._C._nn._parse_to:  # Module.to's argument parser: it makes no tensor
            return func(*args, **kwargs)
        to_cuda = False
        dest = None  # where a .to() sends its tensor: "cuda", "cpu" or None (stays)
        if "device" in kwargs:
            to_cuda = _is_cuda(kwargs["device"])
            if kwargs["device"] is not None:
                dest = "cuda" if to_cuda else "cpu"
            if to_cuda:
                kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        if func in _HOST_READS and args and isinstance(args[0], torch.Tensor) and self.is_tagged(args[0]):
            self.num_syncs += 1
        if _sizes_from_values(func, args, kwargs) and self.is_tagged(args[0]):
            self.num_syncs += 1
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.cuda:
            out = args[0] if self.is_tagged(args[0]) else args[0].clone()
            self._tag(out)
            return out
        if func is torch.Tensor.to:
            src, new_args = args[0], [args[0]]
            src_tagged = self.is_tagged(src)
            for a in args[1:]:
                if isinstance(a, torch.Tensor):
                    dest = "cuda" if self.is_tagged(a) else "cpu"
                elif isinstance(a, (str, torch.device)):
                    dest = "cuda" if _is_cuda(a) else "cpu"
                    a = "cpu" if dest == "cuda" else a
                new_args.append(a)
            out = func(*new_args, **kwargs)
            dest = dest or ("cuda" if src_tagged else "cpu")
            if src_tagged and dest == "cpu":
                self.num_syncs += 1
            if (dest == "cuda") != src_tagged and (out is src or (src.numel() and _same_storage(out, src))):
                out = out.clone()  # a real move copies
            if dest == "cuda":
                self._tag(out)
            return out
        if func is torch.Tensor.cpu:
            out = func(*args, **kwargs)
            return out.clone() if self.is_tagged(args[0]) else out
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            return self._index(func, args, to_cuda)
        if func not in _CROSS_DEVICE_OK:
            flat, _ = tree_flatten((args, kwargs))
            big = [t for t in flat if isinstance(t, torch.Tensor) and t.dim() > 0 and t.device.type != "meta"]
            tags = [self.is_tagged(t) for t in big]
            self.num_checked_ops += 1
            if any(tags) and not all(tags):
                shapes = ", ".join(f"{'cuda' if g else 'cpu'}{tuple(t.shape)}" for t, g in zip(big, tags))
                raise DeviceMixError(f"{_name(func)} mixes device and host tensors: {shapes}")
            to_cuda = to_cuda or any(tags)
        out = func(*args, **kwargs)
        if to_cuda and func not in _CROSS_DEVICE_OK:
            tree_map(lambda t: self._tag(t) if isinstance(t, torch.Tensor) else None, out)
        return out


    def _index(self, func, args, to_cuda: bool):
        # as on CUDA: index tensors may live on either side; a basic-index write is a copy_ (any
        # device); an advanced-index write (index_put_) needs its values on the tensor's device
        self.num_checked_ops += 1
        base, key = args[0], args[1]
        tagged = self.is_tagged(base)
        keys, _ = tree_flatten(key)
        advanced = any(isinstance(k, torch.Tensor) and k.dim() > 0 for k in keys)
        if func is torch.Tensor.__setitem__:
            value = args[2]
            if (advanced and isinstance(value, torch.Tensor) and value.dim() > 0
                    and self.is_tagged(value) != tagged):
                raise DeviceMixError(
                    f"an indexed write (index_put_) mixes device and host tensors: "
                    f"{'cuda' if tagged else 'cpu'}{tuple(base.shape)} <- "
                    f"{'cuda' if not tagged else 'cpu'}{tuple(value.shape)}")
            return func(*args)
        out = func(*args)
        if tagged:
            self._tag(out)
        return out


def _sizes_from_values(func, args, kwargs) -> bool:
    """Whether this call sizes its output from its first tensor's values (a sync on CUDA)."""
    if not args or not isinstance(args[0], torch.Tensor):
        return False
    if func in _SIZE_FROM_VALUES:
        return True
    if func in _REPEATS:  # by a tensor of repeats, unless the caller gives output_size
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        by_tensor = isinstance(repeats, torch.Tensor) and repeats.dim() > 0 or repeats is None
        return by_tensor and kwargs.get("output_size") is None
    if func is torch.Tensor.__getitem__:  # a boolean mask index
        keys, _ = tree_flatten(args[1])
        return any(isinstance(k, torch.Tensor) and k.dtype == torch.bool and k.dim() > 0 for k in keys)
    return False


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    with torch._C.DisableTorchFunction():
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
