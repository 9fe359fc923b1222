"""Which decode batch sizes get a CUDA graph, and which graph a batch replays."""

import pytest

from srt.model_process.cuda_graph_runner import capture_batch_sizes, padded_size


def test_capture_sizes() -> None:
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_batch_sizes(256)[-3:] == [240, 248, 256]
    assert padded_size([1, 2, 4, 8], 3) == 4
    with pytest.raises(ValueError):
        padded_size([1, 2, 4], 5)
