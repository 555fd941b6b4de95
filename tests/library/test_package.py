"""The package's public names stay what they are, whatever has been imported."""
import importlib
import pkgutil
import types

import ds4_torch


def test_no_submodule_shadows_a_public_name():
    """Importing a submodule sets it as an attribute of the package: one named like a name the
    package exports (`ds4_torch.capabilities`, a function) would replace that name."""
    for info in pkgutil.walk_packages(ds4_torch.__path__, "ds4_torch."):
        if not info.name.endswith("__main__"):  # (that one runs the command line)
            importlib.import_module(info.name)
    submodules = {info.name.rpartition(".")[2] for info in pkgutil.iter_modules(ds4_torch.__path__)}
    assert not submodules & set(ds4_torch.__all__), "a submodule is named like a public name"
    for name in ds4_torch.__all__:
        assert not isinstance(getattr(ds4_torch, name), types.ModuleType), name

