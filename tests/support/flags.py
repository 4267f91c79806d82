"""Backend flags shared by the tests (and by the workers they spawn, which see no pytest fixture).

``exact_sgd()``: plain SGD with no momentum and no gradient clipping, so one step changes every
weight by exactly ``-lr * g`` (``g`` the applied gradient). Tests read the gradient off the weights:
``g = (w0 - w1) / lr``. ``--lr`` 1.0 makes the update the gradient itself.
"""

from __future__ import annotations


def exact_sgd(lr: str = "1.0", clip_grad: str = "0") -> list:
    """The flags of exact SGD: ``--optimizer sgd --sgd-momentum 0 --lr LR --clip-grad CLIP``."""
    return ["--optimizer", "sgd", "--sgd-momentum", "0", "--lr", lr, "--clip-grad", clip_grad]


EXACT_SGD = tuple(exact_sgd())
