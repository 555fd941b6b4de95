"""What this machine can run: `ds4_torch.capabilities(device=None)`, and its default device.

(Not `capabilities.py`: a submodule named like the function the package exports would, once
imported, replace that function on the package.)"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class Capability:
    available: bool
    reason: str = ""  # why not, when unavailable

    def __bool__(self) -> bool:
        return self.available

    def __str__(self) -> str:
        return "yes" if self.available else f"no ({self.reason})"


@dataclass(frozen=True)
class Capabilities:
    device: str
    triton: Capability
    cuda_graphs: Capability
    mps: Capability
    compile: Capability
    bf16: Capability
    fp8: Capability

    def table(self) -> str:
        rows = [f"device: {self.device}"]
        rows += [f"{f.name:12s} {getattr(self, f.name)}" for f in fields(self) if f.name != "device"]
        return "\n".join(rows)


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def capabilities(device=None) -> Capabilities:
    device = torch.device(device) if device is not None else default_device()
    kind = device.type
    yes = Capability(True)
    has_triton = importlib.util.find_spec("triton") is not None
    if kind == "cuda":
        if not torch.cuda.is_available():
            no_cuda = Capability(False, "CUDA is not available in this torch build or machine")
            return Capabilities(str(device), no_cuda, no_cuda, Capability(False, "not an MPS device"),
                                no_cuda, no_cuda, no_cuda)
        major, minor = torch.cuda.get_device_capability(device)
        triton = yes if has_triton else Capability(False, "the triton package is not installed")
        bf16 = yes if major >= 8 else Capability(False, f"sm_{major}{minor} has no bf16 (needs sm_80+)")
        fp8 = yes if (major, minor) >= (8, 9) else Capability(False, f"sm_{major}{minor} has no fp8 (needs sm_89+)")
        return Capabilities(str(device), triton, yes, Capability(False, "not an MPS device"), triton, bf16, fp8)
    if kind == "mps":
        mps = yes if torch.backends.mps.is_available() else Capability(False, "MPS is not available")
        return Capabilities(str(device), Capability(False, "Triton does not target Apple GPUs"),
                            Capability(False, "CUDA graphs need a CUDA device"), mps,
                            Capability(False, "torch.compile for MPS is not supported by ds4_torch yet"),
                            mps, Capability(False, "MPS has no fp8 matmul"))
    # CPU: compile works (inductor's C++ backend); Triton only through its interpreter.
    return Capabilities(
        str(device),
        Capability(False, "Triton needs a GPU (on CPU it runs only under TRITON_INTERPRET=1, for tests)"),
        Capability(False, "CUDA graphs need a CUDA device (CPU uses the capture emulator in tests)"),
        Capability(False, "not an MPS device"),
        yes,
        yes,
        Capability(False, "no fp8 matmul on CPU: --quantized dequantize converts FP8/FP4 weights at load; "
                          "--quantized keep holds them packed and unpacks them tile by tile on use"),
    )
