"""The model chunks of the interleaved pipeline schedule (``rl_plugin.backends.megatron.chunks``):
the current chunk is no submodule, the head is the last chunk, and what the backend does to one
DDP model (zero the grad buffer, ``no_sync``) reaches every chunk."""

from __future__ import annotations

import contextlib

import torch

from rl_plugin.backends.megatron.chunks import ModelChunks, chunks_of


class Chunk(torch.nn.Module):
    """The two methods of megatron's DDP that ``ModelChunks`` forwards, recording their calls."""

    def __init__(self, log, name):
        super().__init__()
        self.lin, self.log, self.name = torch.nn.Linear(2, 2), log, name

    def zero_grad_buffer(self):
        self.log.append(("zero", self.name))

    @contextlib.contextmanager
    def no_sync(self):
        self.log.append(("enter", self.name))
        yield
        self.log.append(("exit", self.name))


def test_chunks_forward_to_each_and_the_head_is_the_last():
    log = []
    a, b = Chunk(log, "a"), Chunk(log, "b")
    chunks = ModelChunks([a, b])
    assert chunks.current is None
    chunks.set_current(b)
    assert chunks.current is b and len(list(chunks.children())) == 2  # not registered as a third module
    assert len(list(chunks.parameters())) == 4  # every chunk's parameters reach the optimizer
    assert chunks.is_head(b) and not chunks.is_head(a)
    chunks.zero_grad_buffer()
    with chunks.no_sync():
        log.append(("body", ""))
    assert log == [
        ("zero", "a"),
        ("zero", "b"),
        ("enter", "a"),
        ("enter", "b"),
        ("body", ""),
        ("exit", "b"),
        ("exit", "a"),
    ]
    assert chunks_of(chunks) == [a, b] and chunks_of(a) == [a]
