"""engine.utils.huge_pages: large buffers on 2 MiB-aligned mappings that behave as plain tensors."""

import gc

import pytest
import torch

from engine.utils import huge_pages


@pytest.mark.parametrize("numel", [1, 1000, (3 << 20) + 7])
def test_empty_is_a_plain_writable_tensor(numel):
    t = huge_pages.empty(numel, torch.bfloat16)
    assert t.shape == (numel,) and t.dtype == torch.bfloat16 and t.is_contiguous()
    t.fill_(1.5)
    gc.collect()  # the mapping lives as long as the tensor, not as long as the function's locals
    assert float(t.float().sum()) == 1.5 * numel
    if huge_pages.ENABLED and numel * 2 >= huge_pages.HUGE_PAGE:
        assert t.data_ptr() % huge_pages.HUGE_PAGE == 0


def test_disabled_falls_back_to_torch_empty(monkeypatch):
    monkeypatch.setattr(huge_pages, "ENABLED", False)
    t = huge_pages.empty(3 << 20, torch.float32)
    assert t.shape == (3 << 20,) and t.dtype == torch.float32
