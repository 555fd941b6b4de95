"""Test-wide settings. Runs before any test module imports torch kernels or triton."""
import os

# Triton only runs on CPU through its interpreter, and the switch is read when a
# @triton.jit decorator runs, so it must be set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

# On 2-core machines two threads gave erratic 10x slowdowns in numerical tests.
torch.set_num_threads(1)
