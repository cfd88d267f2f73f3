"""A stand-in for SGLang's kernel package (`sgl_kernel`) on machines without CUDA.

What it stands in for, and why: sglang==0.5.23 imports `sgl_kernel` (PyPI package
`sglang-kernel`) at module level in dozens of places. PyPI ships that package for CUDA
only: on a machine without a GPU its import fails (`libcuda.so.1: cannot open shared
object file`), and with it every `import sglang.srt...`. SGLang's CPU engine
(SGLANG_USE_CPU_ENGINE=1) does not call those kernels: it runs each layer's torch-native
path unless `torch.ops.sgl_kernel.convert_weight_packed` exists (the Intel AMX build,
which is not on PyPI). So the imports only have to succeed; any kernel actually called
raises NotImplementedError naming it.

When it is active: only after the real `sgl_kernel` has been tried and failed to import.
On a machine where the real kernels import (any CUDA host), this module does nothing.

Two CPU guards, also only while the stand-in is active and no accelerator is present:
- Pinning is skipped: `Tensor.pin_memory()` returns the tensor itself and the tensor
  factories SGLang calls with `pin_memory=True` (torch.tensor, empty, zeros, ones, full,
  arange) get `pin_memory=False`. SGLang's LoRA layers and memory pool pin host buffers
  for asynchronous copies to the GPU; without an accelerator torch refuses to pin
  ("Found no NVIDIA driver"), and there is no copy to overlap.
- `torch.cuda.synchronize` / `torch.cuda.empty_cache` are no-ops: the memory saver and
  weight-update paths call them unconditionally; there is no CUDA work to wait for.

This file has no dependency on PlexRL: scripts/sglang.sh copies it into the SGLang
virtualenv as `plexrl_sglang_cpu_shim` and loads it from a .pth line at interpreter start.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

KERNEL_PACKAGE = "sgl_kernel"
SHIM_VERSION = "0.0.0+plexrl-cpu-shim"


class _MissingKernel:
    """What any attribute of the stand-in resolves to: importable, never runnable."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{self._qualname} is a CUDA kernel of sglang-kernel, which is not installed "
            "for this device (the PlexRL CPU shim stands in for its imports only); run "
            "SGLang on a CUDA machine, or keep SGLANG_USE_CPU_ENGINE=1 so it takes the "
            "torch-native path"
        )

    def __getattr__(self, name: str) -> _MissingKernel:
        if name.startswith("__"):
            raise AttributeError(name)
        return _MissingKernel(f"{self._qualname}.{name}")

    def __repr__(self) -> str:
        return f"<missing CUDA kernel {self._qualname}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> _MissingKernel:
        if name.startswith("__"):
            raise AttributeError(name)
        return _MissingKernel(f"{self.__name__}.{name}")


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []  # a package, so `from sgl_kernel.x import y` resolves too
        module.__version__ = SHIM_VERSION  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _KernelFinder(importlib.abc.MetaPathFinder):
    """First on sys.meta_path; decides once, on the first import of sgl_kernel."""

    def __init__(self) -> None:
        self.active = False
        self._decided = False

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != KERNEL_PACKAGE and not fullname.startswith(KERNEL_PACKAGE + "."):
            return None
        if not self._decided:
            self._decided = True
            self.active = not _real_kernels_import()
            if self.active:
                _install_cpu_guards()
        if not self.active:
            return None
        return importlib.machinery.ModuleSpec(fullname, _StandInLoader(), is_package=True)


def _real_kernels_import() -> bool:
    try:
        importlib.import_module(KERNEL_PACKAGE)
    except (ImportError, OSError) as exc:
        for name in [n for n in sys.modules if n.split(".")[0] == KERNEL_PACKAGE]:
            del sys.modules[name]
        # sgl_kernel's message lists each failed attempt as "- Error: ..." under a banner.
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        attempts = [ln[2:] for ln in lines if ln.startswith("- ") and "Error:" in ln]
        reason = "; ".join(attempts) or (lines[-1] if lines else type(exc).__name__)
        print(
            f"[plexrl-cpu-shim] sgl_kernel does not import ({reason}); standing in for it",
            file=sys.stderr,
        )
        return False
    return True


_PINNING_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange")


def _unpinned(factory: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(factory)
    def call(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return factory(*args, **kwargs)

    return call


def _install_cpu_guards() -> None:
    import torch

    if torch.cuda.is_available():
        return

    def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
        return self

    torch.Tensor.pin_memory = pin_memory  # type: ignore[method-assign,assignment]
    for name in _PINNING_FACTORIES:
        setattr(torch, name, _unpinned(getattr(torch, name)))
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.empty_cache = lambda: None


def install() -> None:
    """Put the finder first on sys.meta_path (idempotent)."""
    if not any(isinstance(f, _KernelFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _KernelFinder())


install()
