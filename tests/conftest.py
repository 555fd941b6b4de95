"""Test-wide settings. Runs before any test module imports torch kernels or triton."""
import os

# Triton only runs on CPU through its interpreter, and the switch is read when a
# @triton.jit decorator runs, so it must be set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# On 2-core machines two threads gave erratic 10x slowdowns in numerical tests.
torch.set_num_threads(1)


def pytest_configure(config):
    # (also declared in pyproject.toml; registered here too so the marker exists however pytest is run)
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run with `pytest -m gpu`); skipped, saying so, "
                                       "where none is present")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped, with the reason, on a machine without a CUDA GPU."""
    if torch.cuda.is_available():
        return
    reason = (f"needs a CUDA GPU: torch {torch.__version__} sees none here "
              f"({'a CPU-only build' if torch.version.cuda is None else 'no device visible'})")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def model():
    """The embedded default model, fresh per test module (a module may change its settings).
    Modules that need another model define their own `model`."""
    from ds4_torch.default_model import build_default_model

    return build_default_model()


@pytest.fixture(scope="module")
def tok():
    """The embedded default model's tokenizer."""
    from ds4_torch.default_model import default_tokenizer

    return default_tokenizer()
