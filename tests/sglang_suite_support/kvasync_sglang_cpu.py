"""What tests/sglang_suite.py loads first into every SGLang run on a machine with no CUDA (SGLang's
tests with kvasync and on stock alike, and the plugin's own tests): torchvision's two operator
schemas that its Python part needs at import, when its compiled part could not load.

SGLang 0.5.17 imports torchvision at module import (``sglang.srt.utils.common`` takes
``torchvision.io.decode_jpeg``, used only to decode images on a GPU). PyPI's torchvision wheels
are CUDA builds: on a CPU-only torch their ``_C`` extension does not load (it links
``libc10_cuda.so``), which torchvision tolerates (``extension._has_ops()`` is False and its other
registrations are skipped), except for two: ``torchvision/_meta_registrations.py`` registers fake
kernels for ``torchvision::nms`` and ``torchvision::qnms`` unconditionally, and
``torch.library.register_fake`` fails on an operator that does not exist. torchvision's CPU
build (pytorch's own index) defines them, and nothing here is then changed.

Here the two schemas are defined, with no kernel: ``import torchvision`` then completes as it
does on any build whose ops did not load, ``_has_ops()`` stays False, and a call of either
operator raises torch's "no kernel" error (nothing SGLang's memory pool, allocator or radix cache
calls). The schemas are torchvision's public signatures.

Loaded as a pytest plugin (``-p kvasync_sglang_cpu``), and imported by the runner's import probe.
"""

from __future__ import annotations

import importlib.util

import torch

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library: torch.library.Library | None = None


def torchvision_ops_load() -> bool:
    """Whether torchvision's compiled operators load here (always True without torchvision)."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return True
    import ctypes
    import glob
    import os

    for location in spec.submodule_search_locations:
        for path in glob.glob(os.path.join(location, "_C*.so")):
            try:
                ctypes.CDLL(path)
            except OSError:
                return False
            return True
    return False


def define_missing_schemas() -> bool:
    """Defines torchvision's ``nms``/``qnms`` schemas when its ops cannot load; True if it did."""
    global _library
    if _library is not None or torchvision_ops_load():
        return _library is not None
    _library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS:
        _library.define(schema)
    return True


DEFINED = define_missing_schemas()


def pytest_report_header() -> str:
    if DEFINED:
        return (
            "kvasync_sglang_cpu: torchvision's compiled ops do not load on this CPU torch; its "
            "nms/qnms schemas are defined without kernels so that it imports"
        )
    return "kvasync_sglang_cpu: torchvision's compiled ops load; nothing defined"
