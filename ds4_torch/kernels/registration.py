"""How each `torch.ops.ds4.*` op is defined: the schema read from its Python signature, one body
for every device (the body picks the kernel by device and backend name; CUDA is registered by name
too, so the dispatcher lists its kernel), a fake for tracing, and a backward that refuses.

torch.library.define/impl rather than torch.library.custom_op: custom_op wraps each device kernel
so that the first call of any op imports torch._dynamo, 1-2 s added to every process's first
forward; these ops need nothing else of custom_op's."""

from __future__ import annotations

from typing import Callable

import torch

_LIBRARY = torch.library.Library("ds4", "DEF")


def define_op(name: str, fake: Callable) -> Callable[[Callable], torch._ops.OpOverloadPacket]:
    """Decorator: `fn` becomes `torch.ops.ds4.<name>` (returned), `fake` its shapes-only twin."""

    def define(fn: Callable) -> torch._ops.OpOverloadPacket:
        qualname = f"ds4::{name}"
        _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=()),
                        tags=(torch.Tag.pt2_compliant_tag,))
        for key in ("CompositeExplicitAutograd", "CUDA"):
            _LIBRARY.impl(name, fn, key)
        torch.library.register_fake(qualname, fake, lib=_LIBRARY)

        def backward(ctx, *grads):
            raise RuntimeError(f"{qualname} is forward-only (an inference kernel): it has no backward")

        torch.library.register_autograd(qualname, backward, lib=_LIBRARY)
        return getattr(torch.ops.ds4, name)

    return define
