"""A stand-in accelerator on a CPU-only machine, to catch device bugs before a GPU ever runs the code.

`FAKE_GPU` is PyTorch's spare backend slot (privateuseone, named "fakegpu") given a Python device guard.
Tensors asked for on it (factories with `device=FAKE_GPU`, `.to(FAKE_GPU)`, a module's parameters) are
real CPU tensors wrapped in `FakeGpuTensor`, whose `.device` is the fake one. Every op runs for real on the
CPU data (values, `.item()`, `.tolist()`, autograd all work), but first checks the rules CUDA enforces: no
op mixes accelerator tensors with CPU tensors (0-dim CPU scalars, and CPU indices in indexing, excepted),
and no CPU generator samples accelerator tensors. So the engine and the trainer run end to end on the fake
device, and a tensor made without `device=` that meets a device tensor raises the error the GPU would raise.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map


class _BackendModule(torch.utils.backend_registration._DummyBackendModule):
    def get_amp_supported_dtype(self) -> list[torch.dtype]:  # autocast asks (it casts nothing here)
        return [torch.bfloat16, torch.float16]


# renamed, so that torch counts it as the accelerator (autograd's engine asks for one in backward)
torch.utils.backend_registration._setup_privateuseone_for_python_backend(
    "fakegpu", backend_module=_BackendModule())
FAKE_GPU = torch.device("fakegpu", 0)
aten = torch.ops.aten
# CUDA accepts CPU index tensors here (it moves them itself)
CPU_INDICES_OK = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                  aten._index_put_impl_.default}
# cross-device by design
CROSS_DEVICE = {aten._to_copy.default, aten.copy_.default, aten._local_scalar_dense.default}


class FakeGpuTensor(torch.Tensor):
    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            layout=elem.layout, device=FAKE_GPU, requires_grad=elem.requires_grad)
        out.elem = elem
        return out

    def __repr__(self) -> str:
        return f"FakeGpuTensor({self.elem!r})"

    def tolist(self):
        return self.elem.tolist()

    def numpy(self, *, force: bool = False):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the "
                        "tensor to host memory first.")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _on_fake_gpu(device) -> bool:
    return device is not None and torch.device(device).type == FAKE_GPU.type


def _check(func, flat: list, on_gpu: bool) -> None:
    if not on_gpu:
        return
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    for g in (x for x in flat if isinstance(x, torch.Generator)):
        raise RuntimeError(f"{func}: Expected a 'cuda' device type for generator but found "
                           f"'{g.device.type}'")
    if func in CROSS_DEVICE:
        return
    for i, t in enumerate(tensors):
        if isinstance(t, FakeGpuTensor) or t.dim() == 0:
            continue
        if func in CPU_INDICES_OK and i > 0 and t.dtype in (torch.long, torch.int, torch.bool):
            continue
        raise RuntimeError(f"{func}: Expected all tensors to be on the same device, "
                           f"but found at least two devices, cuda:0 and cpu! "
                           f"(a CPU tensor of shape {tuple(t.shape)} met a device tensor)")


def _run(func, args, kwargs):
    flat = []
    tree_map(flat.append, (args, kwargs))
    to_gpu = _on_fake_gpu(kwargs.get("device"))
    _check(func, flat, to_gpu or any(isinstance(x, FakeGpuTensor) for x in flat))
    if to_gpu:
        kwargs = {**kwargs, "device": torch.device("cpu")}
    # a factory, .to(device), .cpu(): the output lives where it was asked for;
    # any other op where its inputs do
    on_gpu = to_gpu if "device" in kwargs else any(isinstance(x, FakeGpuTensor) for x in flat)
    args, kwargs = tree_map(lambda x: x.elem if isinstance(x, FakeGpuTensor) else x, (args, kwargs))
    out = func(*args, **kwargs)
    if func is aten._local_scalar_dense.default or not on_gpu:
        return out
    return tree_map(lambda x: FakeGpuTensor(x) if isinstance(x, torch.Tensor) else x, out)


class _FactoryMode(TorchDispatchMode):
    """Catches ops on plain tensors that ask for the fake device (factories, .to(FAKE_GPU))."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:  # e.g. aten.to.*: into the ops it is made of (_to_copy), which this mode handles
                out = func.decompose(*args, **(kwargs or {}))
            if out is not NotImplemented:
                return out
        return _run(func, args, kwargs or {})


def _built_on_cpu(make):
    """torch.tensor / as_tensor build on the CPU and move with dispatch modes switched off, which would
    reach the bare backend: build on the CPU here and move through the mode instead."""

    def build(data, *args, device=None, **kwargs):
        out = make(data, *args, **kwargs)
        return out if device is None else out.to(device)

    return build


def _list_indices_on_cpu(method):
    """x[[0, 2]]: indexing builds a list index on x's device with dispatch modes switched off (the bare
    backend); a CPU index tensor means the same and CUDA accepts it."""

    def index(self, key, *value):
        if isinstance(self, FakeGpuTensor):
            parts = key if isinstance(key, tuple) else (key,)
            parts = tuple(torch.tensor(k) if isinstance(k, list) else k for k in parts)
            key = parts if isinstance(key, tuple) else parts[0]
        return method(self, key, *value)

    return index


class _NoGradForInference:
    """inference_mode -> no_grad: views made in __torch_dispatch__ cannot be inference tensors."""

    def __init__(self, mode: bool) -> None:
        self.mode, self.prev = mode, None

    def __enter__(self) -> None:
        self.prev = torch.is_grad_enabled()
        if self.mode:
            torch._C._set_grad_enabled(False)

    def __exit__(self, *exc) -> None:
        torch._C._set_grad_enabled(self.prev)


@contextlib.contextmanager
def fake_gpu():
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch._C, "_InferenceMode", _NoGradForInference))
        for name in ("__getitem__", "__setitem__"):
            stack.enter_context(mock.patch.object(torch.Tensor, name,
                                                  _list_indices_on_cpu(getattr(torch.Tensor, name))))
        for name in ("tensor", "as_tensor"):
            stack.enter_context(mock.patch.object(torch, name, _built_on_cpu(getattr(torch, name))))
        stack.enter_context(_FactoryMode())
        yield
