"""The int8 benchmark refuses wrong arguments before timing anything, and its quantizer keeps
one scale per output row."""

import pytest
import torch

from loadtest.int8_bench import main, quantize_per_channel


@pytest.mark.parametrize("argv", [["--rows", "a,b"], ["--rows", "0"], ["--repeats", "0"]])
def test_wrong_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2


def test_per_channel_quantization_round_trips_within_half_a_step():
    weight = torch.randn(16, 32)
    quantized, scales = quantize_per_channel(weight)
    assert quantized.dtype == torch.int8 and scales.shape == (16,)
    error = (quantized.float() * scales[:, None] - weight).abs()
    assert bool((error <= scales[:, None] / 2 + 1e-6).all())
