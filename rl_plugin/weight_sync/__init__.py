"""Moving the trainer's weights into the rollout engines: in place, bucketed, only what changed.

One subsystem with its state inside it. A sync is versioned (1, 2, ...) and has three sides:

- train rank 0's ``WeightPublisher`` (``publisher.py``): the train ranks export (the backend's
  ``stream_hf_weights``, collective; only the ranks that must gather do, only rank 0 gets the
  tensors), rank 0 publishes each tensor as it arrives (``publish_stream``) through the
  transports (``transport.py``: shared memory, object store, distributed) into a ``SyncHandle``;
- each engine's ``WeightReceiver`` (``receiver.py``): reads the handle through the transport that
  serves it and loads the buckets in place (``load_sync``);
- the driver's ``WeightLedger`` (``ledger.py``): which version the engines hold, what was
  published and not yet loaded, the fingerprints to compare (``--check-weight-sync``), the time.

``SyncSettings`` (``settings.py``) declares the flags (transport, bucket size, the check).

Every parameter travels at most once per sync: tied names never, a frozen tensor once (at the
first sync), a trained tensor when it changed (``changed_at``), a fused q/k/v or gate/up group
whole (``buckets.py``). In the loop the sync rides on calls made anyway: the train call of rollout
k publishes at its end, the next manager call (generate or evaluate) loads before it samples.

The names below resolve lazily (``__getattr__``): importing ``SyncSettings`` (the flags' config, read
by the parser) imports no torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "changed_bitwise": "buckets",
    "fused_group": "buckets",
    "iter_buckets": "buckets",
    "plan_buckets": "buckets",
    "tensor_bytes": "buckets",
    "compare_fingerprints": "fingerprint",
    "weights_fingerprint": "fingerprint",
    "SyncHandle": "handle",
    "SyncRequest": "handle",
    "node_id": "handle",
    "WeightLedger": "ledger",
    "WeightPublisher": "publisher",
    "WeightReceiver": "receiver",
    "load_sync": "receiver",
    "SyncSettings": "settings",
    "TRANSPORTS": "transport",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"rl_plugin.weight_sync.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'rl_plugin.weight_sync' has no attribute {name!r}")
