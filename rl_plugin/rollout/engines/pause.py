"""The token-boundary pause of a generation in flight (fully asynchronous training, partial rollouts).

Under ``--fully-async`` a background thread of the rollout manager generates while the manager's
calls (a weight load, an eval) arrive on another thread. ``GenerationGate`` is their handshake:

- the generating thread holds the gate while it runs a forward pass (``enter``), and offers it at
  every token boundary (``boundary``): between two decode steps nothing of the model is in use;
- a call that must change or use the engine (``exclusive``) waits until the generating thread is
  at a boundary (or idle), runs while that thread waits, then lets it go on;
- ``version`` is the weight version the engine holds (set inside ``exclusive`` by the weight load);
  ``boundary`` returns it, so the sampler records the version of every token it draws and, when it
  changed, continues under the new weights: ``mode`` ``retract`` prefills the tokens so far again
  (every later log-prob is the new weights' exact one), ``in_place`` keeps the KV cache the old
  weights computed.

``on_generations_done`` (optional, set for ``--rollout-submission-granularity sample`` by the
producer, or by an engine actor's stream, ``EngineActor.generate_stream``) is called at a boundary
with the samples of the engine call that finished since the last boundary, so their groups can
reach the buffer before the longest trajectory ends (the hf engine maps the sampler's
``on_rows_done`` rows to them; vLLM's stepped generation reports its finished requests).

An engine that cannot pause (``model.generate``'s fallback) calls ``enter`` / ``leave`` only: a
load then waits for the whole call, and its tokens all carry the version of the start.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, List, Optional

MODES = ("retract", "in_place")


class GenerationGate:
    def __init__(self, mode: str = "retract", version: int = 0):
        if mode not in MODES:
            raise ValueError(f"pause mode {mode!r}: expected one of {MODES}")
        self.mode, self.version = mode, int(version)
        self._cv = threading.Condition()
        self._waiting = 0  # exclusive calls waiting or running
        self._inside = False  # the generating thread is in a forward pass
        self.pauses = 0  # boundaries at which a caller ran (weight loads, evals)
        # set by the producer: (indices in the engine call, their finished Generations) at a boundary
        self.on_generations_done: Optional[Callable[[List[int], list], None]] = None
        # set by the engine per sampler call: (rows, (tokens, log_probs, versions) so far)
        self.on_rows_done: Optional[Callable[[List[int], object], None]] = None

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Run the body while the generating thread waits at a token boundary (or is idle)."""
        with self._cv:
            self._waiting += 1
            self._cv.wait_for(lambda: not self._inside)
        try:
            yield
        finally:
            with self._cv:
                self._waiting -= 1
                self.pauses += 1
                self._cv.notify_all()

    def enter(self) -> int:
        """The generating thread starts a call: waits for the callers first; returns the version."""
        with self._cv:
            self._cv.wait_for(lambda: self._waiting == 0)
            self._inside = True
            return self.version

    def boundary(self) -> int:
        """A token boundary: let waiting callers run, then go on; returns the version now held."""
        with self._cv:
            if self._waiting:
                self._inside = False
                self._cv.notify_all()
                self._cv.wait_for(lambda: self._waiting == 0)
                self._inside = True
            return self.version

    def leave(self) -> None:
        with self._cv:
            self._inside = False
            self._cv.notify_all()
