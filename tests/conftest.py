"""Test-wide set-up. Triton runs its kernels on CPU tensors through its interpreter here; the
variable must be set before anything imports triton."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
