"""Without Triton (the CPU container image leaves it out): the kernels and the model import, the
CPU path runs, and asking for a Triton kernel fails with a clear error."""

import subprocess
import sys
import textwrap

# Run in a fresh interpreter in which `import triton` fails as it does where it is not installed.
WITHOUT_TRITON = textwrap.dedent(
    """
    import sys
    sys.modules["triton"] = None  # import triton -> ModuleNotFoundError

    import torch
    from kernels import optional_triton
    from kernels.kv_write import write_kv
    from kernels.paged_attention import paged_attention
    from shared.engine.model import LlamaModel  # the model imports every kernel module

    assert not optional_triton.HAVE_TRITON
    cache = torch.zeros(2, 4, 1, 2)
    key = torch.ones(1, 1, 2)
    write_kv(key, key * 2, cache, cache.clone(), torch.tensor([5]))
    assert cache[1, 1].tolist() == [[1.0, 1.0]], cache
    try:
        write_kv(key, key, cache, cache.clone(), torch.tensor([5]), use_triton=True)
    except optional_triton.TritonMissingError as error:
        print("ERROR:", error)
    """
)


def test_kernels_import_and_run_on_the_cpu_without_triton():
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("ERROR:")]
    assert "Triton kernel _write_kv_kernel needs Triton, which is not installed" in line
    assert "leave use_triton unset" in line


def test_triton_is_the_real_module_where_installed():
    from kernels import optional_triton

    assert optional_triton.HAVE_TRITON
    assert optional_triton.triton.__name__ == "triton"
