"""The preallocated KV cache layer: same contents as concatenation, in place while it has room."""

from __future__ import annotations

import torch

from veriloop.agents.backends.hf import SpareLayer


def test_spare_layer_matches_concatenation_and_grows() -> None:
    torch.manual_seed(0)
    first = torch.randn(3, 2, 4, 5), torch.randn(3, 2, 4, 5)
    buf = torch.zeros(3, 2, 6, 5), torch.zeros(3, 2, 6, 5)
    buf[0][:, :, :4], buf[1][:, :, :4] = first
    layer = SpareLayer(6, buf, length=4)
    keys, values = first
    for step in range(5):  # 4 + 5 columns: past the 6 reserved ones, so the buffer must grow
        k, v = torch.randn(3, 2, 1, 5), torch.randn(3, 2, 1, 5)
        keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
        out_k, out_v = layer.update(k, v)
        assert torch.equal(out_k, keys) and torch.equal(out_v, values)
        assert layer.get_seq_length() == 5 + step
        if step < 2:  # still inside the first buffer: written in place
            assert out_k.data_ptr() == buf[0].data_ptr()
    layer.batch_select_indices(torch.tensor([2, 0]))
    assert torch.equal(layer.keys, keys[[2, 0]]) and torch.equal(layer.values, values[[2, 0]])
    k = torch.randn(2, 2, 1, 5)
    assert torch.equal(layer.update(k, k)[0], torch.cat([keys[[2, 0]], k], 2))


def test_spare_layer_lazy_prefill() -> None:
    layer = SpareLayer(10)
    assert layer.get_seq_length() == 0
    k = torch.randn(2, 3, 7, 4)
    out_k, _ = layer.update(k, k + 1)
    assert torch.equal(out_k, k) and layer.buf_k.shape == (2, 3, 10, 4) and layer.get_seq_length() == 7
