"""Shared test setup.

NOTE: Triton decides at kernel definition whether to interpret, so TRITON_INTERPRET must be set
before kvasync.kernels is first imported; this module is imported before any test module.
Without a GPU, Triton's interpreter runs the kernels on CPU tensors (~1 ms per program instance).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
